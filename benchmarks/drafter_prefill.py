"""What the drafter costs a job's prefill (issue 36, item 1): its prompt context is written by the
first drafting cycle (engine/batch.py: ``write_prompts``), not by the prefill passes, so a job
decoded plainly never pays for it.

    python -m benchmarks.drafter_prefill --shape qwen3-4b --out docs/results        # GPU
    python -m benchmarks.drafter_prefill --shape qwen3-small --out docs/results     # this CPU
    python -m benchmarks.drafter_prefill --smoke --out /tmp/x                        # a tiny check

Three engines over one target (random weights) and its DFlash drafter, the same job (``--prompts``
random prompts of ``--context`` tokens, ``--max-tokens`` new tokens, batch ``--batch``), each
after a warm-up job at that batch size:

  plain       no drafter
  never       the drafter attached, a cost model under which drafting never pays: every cycle
              plain, so no drafter work at all (the prompts' context is never written)
  drafting    the drafter attached, every cycle verifying a whole block: the first cycle writes
              every prompt's context (``Engine.context_counts``)

Reported per engine: prefill seconds (the target's packed passes), the drafter's prompt-context
seconds and rows, wall seconds. The drafter's share of prefill is drafting's context seconds over
plain's prefill seconds. Written to ``--out`` as drafter-prefill-<machine>-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import Engine
from dflash_batch.engine.widths import CostModel

import mlx.core as mx

from . import arms, batched

ROOT = Path(__file__).resolve().parent.parent
SMOKE = dict(shape="qwen3-tiny", prompts=4, context=64, max_tokens=4, batch=4)
NEVER_PAYS = CostModel(
    t0=1.0, t1=0.05, d0=1e6, window=0
)  # a drafter pass dearer than any job's plain cycles


def engines(args) -> Tuple[Dict[str, Engine], int]:
    """The three engines (module doc) and the vocabulary size."""
    dtype = mx.float32 if args.dtype == "float32" else mx.bfloat16
    setup = arms.build_setup(args.shape, dtype, with_ar_draft=False)
    config = arms.text_config(setup.shape.target)

    def engine(
        drafter, **kw
    ) -> Engine:  # each its own copy of the target: an engine wraps its layers
        return Engine(
            arms.engine_setup(setup).model,
            setup.tokenizer,
            drafter,
            config=config,
            prefix_cache_mb=0,
            **kw,
        )

    return {
        "plain": engine(None),
        "never": engine(setup.drafter, cost_model=NEVER_PAYS),
        "drafting": engine(setup.drafter, adaptive_block=False),
    }, setup.vocab_size


def measure(engine: Engine, prompts: list, args) -> Dict[str, Any]:
    batched.run_engine(
        engine, prompts[: args.batch], min(arms.WARM_TOKENS, args.max_tokens), args.batch
    )
    out = batched.run_engine(engine, prompts, args.max_tokens, args.batch)
    context = dict(getattr(engine, "context_counts", {}))
    arms.release()
    return {
        "prefill_s": round(out["prefill_s"], 4),
        "context_s": round(context.get("seconds", 0.0), 4),
        "context_rows": context.get("rows", 0),
        "wall_s": round(out["wall_s"], 4),
        "cycles": out["cycles"],
    }


def markdown(doc: Dict[str, Any]) -> str:
    lines = [
        f"# Drafter prefill: {doc['machine']}, {doc['date']}",
        "",
        f"`{doc['command']}`",
        "",
        f"{doc['shape']}, {doc['prompts']} prompts of {doc['context']} tokens, {doc['max_tokens']} new, B={doc['batch']}",
        "",
        "| engine | prefill s | drafter prompt context s (rows) | wall s |",
        "| --- | --- | --- | --- |",
    ]
    for name, f in doc["engines"].items():
        lines.append(
            f"| {name} | {f['prefill_s']:.3f} | {f['context_s']:.3f} ({f['context_rows']}) | {f['wall_s']:.3f} |"
        )
    lines += [
        "",
        f"The drafter's prompt context: {doc['drafter_share']:.2f}x the plain engine's prefill.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: float32 on CPU, bfloat16 on GPU",
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny shape and job: checks the harness, measures nothing",
    )
    ap.add_argument("--machine", default=platform.node() or "machine")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    arms.apply_smoke(args, SMOKE)
    built, vocab = engines(args)
    prompts = batched.job_prompts(args.prompts, args.context, vocab)
    figures = {name: measure(engine, prompts, args) for name, engine in built.items()}
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    doc = {
        "machine": args.machine,
        "date": date,
        "mlx": mx.__version__,
        "smoke": args.smoke,
        "command": "python -m benchmarks.drafter_prefill "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": args.shape,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "batch": args.batch,
        "engines": figures,
        "drafter_share": figures["drafting"]["context_s"]
        / max(figures["plain"]["prefill_s"], 1e-9),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"drafter-prefill-{args.machine}-{doc['date']}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return stem.with_suffix(".md")


if __name__ == "__main__":
    main()
