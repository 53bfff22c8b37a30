"""A/B of the drafter's attention in one process: the current ``engine/models/drafter.py`` against an
older copy of that file (its ``Attention.__call__`` swapped in at run time, same weights).

    git show <commit>:dflash_batch/engine/models/drafter.py > /tmp/drafter_old.py
    python -m benchmarks.drafter_ab --old /tmp/drafter_old.py --cycles      # GPU: Qwen3-4B shapes, bf16
    python -m benchmarks.drafter_ab --old /tmp/drafter_old.py --default-pair --new-rows 3 --outputs   # CPU

The older copy must share the current cache protocol (``RaggedKVCache``, ``counts``): copies
from before the batched engine (e.g. 8f034b8, the figures in docs/results/gpu-attention.md) used
mlx-lm's KVCache and ran with the tool as it was at commit 7a8da8d.

Reports the primitives in one draft graph (``mx.export_to_dot``), the draft pass in ms (median
of alternating calls, each over ``--new-rows`` new context rows), and with ``--cycles`` full
DFlash cycles (every block accepted) against mlx_lm AR in rotated rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import tempfile

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx)
from dflash_batch.engine import decode, load_engine
from dflash_batch.engine.models import drafter as current
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx

from benchmarks.gpu_attention import dflash_rate, mlx_lm_ar_rate, timed


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("dflash_batch.engine.drafter_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def draft(drafter, target, last, ctx, cache) -> mx.array:
    """One draft pass over ``ctx`` new context rows; the cache's length is left as it was, so
    every call drafts from the same context."""
    return decode.draft_block(drafter, target, last, ctx, None, cache, drafter.args.block_size - 1)


def primitives(drafter, target, last, ctx, cache) -> int:
    """Primitives in the graph of one draft pass."""
    out = draft(drafter, target, last, ctx, cache)
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        n = len(re.findall(r"shape=rectangle", open(f.name).read()))
    mx.eval(out, [c.arrays() for c in cache])  # so that the next graph does not include this one
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", required=True, help="an older engine/models/drafter.py")
    ap.add_argument(
        "--default-pair",
        action="store_true",
        help="the embedded SmolLM2 pair (else a benchmarks.shapes shape)",
    )
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-rows", type=int, default=16, help="new context rows per draft pass")
    ap.add_argument("--calls", type=int, default=80)
    ap.add_argument(
        "--cycles", action="store_true", help="also full cycles against mlx_lm AR (5 rounds)"
    )
    ap.add_argument(
        "--outputs",
        action="store_true",
        help="with --default-pair: greedy outputs and tokens per cycle of both, on four prompts",
    )
    args = ap.parse_args(argv)
    calls = {"new": current.Attention.__call__, "old": load_old(args.old).Attention.__call__}

    if args.default_pair:
        engine = load_engine()
        target, drafter, model = engine.target, engine.drafter, engine.target.model
        text = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 6
        prompt = engine.tokenizer.encode(text)[: args.context]
    else:
        from dflash_batch.engine.models.target import Target
        from dflash_batch.engine.ops import attention as routing

        from benchmarks.shapes import SHAPES, build_drafter, build_target

        shape = SHAPES[args.shape]
        dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
        model = build_target(shape.target, dtype)
        routing.install(model)
        drafter = build_drafter(shape.drafter, shape.target["hidden_size"], dtype)
        model.model.embed_tokens.weight = mx.zeros_like(
            model.model.embed_tokens.weight
        )  # every block accepted
        mx.eval(model.parameters())
        target = Target(model, tap_ids=drafter.args.target_layer_ids)
        prompt = mx.random.randint(0, 1000, (args.context,)).tolist()

    lengths, draft_lengths = Lengths([0]), Lengths([0])
    cache, dcache = target.make_cache(lengths), drafter.make_cache(draft_lengths)
    logits, context = decode.prefill(target, prompt, cache, lengths, 2048)
    last = mx.argmax(logits, axis=-1).astype(mx.int32)
    drafter.add_context(context[:, : -args.new_rows], dcache)  # the drafter cache holds the prompt
    draft_lengths.advance([context.shape[1] - args.new_rows])
    mx.eval([c.arrays() for c in dcache])
    ctx = context[:, -args.new_rows :, :]
    out = {
        "command": "python -m benchmarks.drafter_ab " + " ".join(argv or sys.argv[1:]),
        "device": str(mx.default_device()),
        "primitives_per_draft_pass": {},
    }
    for name, call in calls.items():
        current.Attention.__call__ = call
        out["primitives_per_draft_pass"][name] = primitives(drafter, target, last, ctx, dcache)
    ts = {k: [] for k in calls}
    for r in range(args.calls):
        for name in ("new", "old") if r % 2 else ("old", "new"):
            current.Attention.__call__ = calls[name]
            ts[name].append(timed(lambda: draft(drafter, target, last, ctx, dcache)))
    out["draft_ms_median"] = {k: round(statistics.median(v[10:]), 3) for k, v in ts.items()}
    print(json.dumps(out), flush=True)

    if args.outputs and args.default_pair:
        prompts = [
            "Explain why the sky is blue in two sentences.",
            "Write a haiku about autumn.",
            "List three uses of a paperclip.",
            "What is 17 times 23? Show your work.",
        ]
        runs = {}
        for name, call in calls.items():
            current.Attention.__call__ = call
            runs[name] = [engine.generate(p, max_tokens=96) for p in prompts]
        out["same_outputs"] = all(
            a.token_ids == b.token_ids for a, b in zip(runs["new"], runs["old"])
        )
        out["tokens_per_cycle"] = {k: [None if c.stats.cycles == 0 else round(c.stats.tokens_per_cycle, 3) for c in v]
                                   for k, v in runs.items()}  # fmt: skip
        print(json.dumps(out), flush=True)

    if args.cycles:
        for name in calls:
            current.Attention.__call__ = calls[name]
            dflash_rate(target, drafter, prompt, 64)  # warm-up
        rates = {k: [] for k in list(calls) + ["ar"]}
        order = ["new", "old", "ar"]
        for r in range(5):
            for name in order[r % 3 :] + order[: r % 3]:
                if name == "ar":
                    rates["ar"].append(mlx_lm_ar_rate(model, prompt, 257)["tok_s"])
                else:
                    current.Attention.__call__ = calls[name]
                    rates[name].append(dflash_rate(target, drafter, prompt, 513)["tok_s"])
        out["cycle_tok_s"] = rates
        out["speedup_vs_mlx_lm_ar"] = {
            k: round(statistics.median(rates[k]) / statistics.median(rates["ar"]), 2) for k in calls
        }
        print(json.dumps(out), flush=True)
    current.Attention.__call__ = calls["new"]


if __name__ == "__main__":
    main()
