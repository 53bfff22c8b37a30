"""Where a batch-1 decoding cycle of the default pair goes, piece by piece, beside a plain
``mlx_lm.stream_generate`` step: ``python -m benchmarks.cycle_pieces``.

Held-out prompts decode one at a time through the engine as users run it (adaptive widths,
trees or chains as the backend's default), each piece forced to finish before the next starts
(an ``mx.eval`` after it):

  draft     the drafter's pass (a tree's candidates included)
  verify    the target's pass, per width T
  move      a draft tree's accepted path moved to the row's front columns (cycles that left the
            drafter's top chain: engine/tree.py)
  rest      the cycle's other time: growing the tree, the width choice, the choice of tokens, the
            walk, bookkeeping

and ``step``: ``stream_generate``'s time per token on the same prompts (mlx-lm's own ops). Since
a cycle commits ``tokens_per_cycle`` tokens, the decode speed-up is about tokens_per_cycle /
(cycle_ms / step_ms). On a CPU, MLX computes while the host waits anyway, so the pieces add up
to the cycle; on a GPU the syncs remove the overlap of host and device, and the pieces say what
each costs alone, not what the cycle costs as run.

Measured (this shared 2-core VM, mlx[cpu] 0.32.4, fp32, 4 held-out prompts x 128 tokens):
2026-11-25, ``docs/results/cycle-pieces-cpu-2core-2026-11-25.json`` (docs/results/batched.md, "Draft
trees"); 2026-11-27 with the CPU ops, ``...-2026-11-27-cpu-ops.json`` (docs/results/batched.md, "CPU ops").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import ExitStack
from typing import Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import decode, load_engine, load_target, pick_dtype
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.models import target as target_module

import mlx.core as mx

from .cycle_host import patched
from .default_pair import command_line, held_out_prompts, run_engine, run_mlx_lm, write_result


def instrument(seconds: Dict[str, List[float]]) -> ExitStack:
    """Time each piece of a cycle to its end (an eval after it), and every cycle whole; passes
    outside cycles (warm-up, prefill) are not counted."""
    stack = ExitStack()
    depth = [0]  # cycles open

    def timed(owner, name: str, label, done):
        inner = owner.__dict__[name]

        def wrapper(*args, **kwargs):
            counted = depth[0] > 0 or label == "cycle"
            depth[0] += label == "cycle"
            started = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
                done(out, args)
            finally:
                depth[0] -= label == "cycle"
            if counted:
                seconds[label(args) if callable(label) else label].append(
                    time.perf_counter() - started
                )
            return out

        stack.enter_context(patched(owner, name, wrapper))

    evaluated = lambda out, args: mx.eval(out)  # noqa: E731
    timed(decode, "draft_candidates", "draft", evaluated)
    timed(decode, "draft_block", "draft", evaluated)
    timed(
        target_module.Target, "decode_pass", lambda args: f"verify T={args[1].shape[1]}", evaluated
    )
    timed(
        target_module.Target,
        "reorder",
        "move",
        lambda out, args: mx.eval([c.arrays() for c in args[1]]),
    )
    timed(BatchDecoder, "run", "cycle", lambda out, args: None)
    return stack


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument("--draft", help="drafter folder (default: the target's registered drafter)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--samples", default="benchmarks/data/smollm2-held-out-prompts.jsonl")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    engine = load_engine(args.target, args.draft or "auto", dtype=args.dtype)
    if engine.drafter is None:
        raise SystemExit("needs a drafter")
    target_folder = engine.description["target"]
    if args.target is None:
        from dflash_batch.engine.models.default_model import ensure_default_pair

        target_folder = ensure_default_pair()[0]
    model, tokenizer, _ = load_target(target_folder, None, pick_dtype(args.dtype))
    prompts = [p["prompt"] for p in held_out_prompts(tokenizer, args.prompts, args.samples)]
    run_mlx_lm(model, tokenizer, prompts[0], 16)  # warm-up: both sides, the engine's costs timed
    run_engine(engine, prompts[0], 16)

    step_tokens, step_seconds = 0, 0.0
    for p in prompts:
        ids, tps, _ = run_mlx_lm(model, tokenizer, p, args.max_tokens)
        if len(ids) > 1:
            step_tokens, step_seconds = (
                step_tokens + len(ids) - 1,
                step_seconds + (len(ids) - 1) / tps,
            )
    seconds: Dict[str, List[float]] = defaultdict(list)
    tokens = 0
    with instrument(seconds):
        for p in prompts:
            tokens += len(run_engine(engine, p, args.max_tokens)[0])
    cycles = len(seconds["cycle"])
    per_cycle = lambda key: 1e3 * sum(seconds[key]) / max(cycles, 1)  # noqa: E731
    verify = sorted(
        (k for k in seconds if k.startswith("verify")), key=lambda k: int(k.split("=")[1])
    )
    cycle_ms = per_cycle("cycle")
    pieces = {
        "draft": per_cycle("draft"),
        **{k: per_cycle(k) for k in verify},
        "move": per_cycle("move"),
    }
    pieces["rest"] = cycle_ms - sum(pieces.values())
    step_ms = 1e3 * step_seconds / max(step_tokens, 1)
    result = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "drafts": engine.description.get("drafts"),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "cycles": cycles,
        "tokens_per_cycle": round(tokens / max(cycles, 1), 3),
        "cycle_ms": round(cycle_ms, 2),
        "ms_per_cycle": {k: round(v, 2) for k, v in pieces.items()},
        "verify_ms_per_pass": {
            k: [len(seconds[k]), round(1e3 * statistics.mean(seconds[k]), 2)] for k in verify
        },
        "move_share_of_cycles": round(len(seconds["move"]) / max(cycles, 1), 3),
        "step_ms": round(step_ms, 2),
        "cycle_in_steps": round(cycle_ms / step_ms, 3) if step_tokens else None,
        "command": command_line("cycle_pieces", argv),
    }
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
