"""Speculation that never loses (issue 36): the engine with a drafter against the same engine
without one, same job, same batch size, side by side in one process.

    python -m benchmarks.never_loses --shape qwen3-4b --out docs/results          # GPU
    python -m benchmarks.never_loses --shape qwen3-small --out docs/results       # this CPU
    python -m benchmarks.never_loses --smoke --out /tmp/x                          # a tiny check

Two parts:

  random drafter   the shape's target (random weights) with its DFlash drafter (random weights:
                   its drafts fail, about 1 token a cycle) against the target alone, a job of
                   ``--prompts`` random prompts of ``--context`` tokens and ``--max-tokens`` new
                   tokens, at every batch size of ``--batches``. Goal: >= 0.95x everywhere.
  default pair     the embedded default pair (SmolLM2-135M-Instruct and its drafter) against its
                   target alone on short chat prompts (benchmarks/data/chat-prompts.jsonl), at
                   ``--pair-batches``. Goal: >= 1.0x, and never slower than the better of the two.

Each arm first runs a warm-up job at the batch size (compilation, its pass costs: a shorter job
for the random drafter, the job itself for the default pair), then the two arms alternate for
``--reps`` timed runs of the whole job (wall time, prefill included), in turns A B, B A, ...: a
load that comes and goes on the machine falls on both. Reported: the median tok/s of each arm,
the ratio, tokens per cycle, the plain cycles' mean cost with and without the drafter
(``Engine.decode_counts``), and the cycles of a shape (rows, verify width, key bucket:
``Engine.shapes_seen``) the engine had not run before, and of a (rows, width) it had not run at
any key bucket, in the warm-up job and in the timed runs (a GPU compiles a new width or batch
size, at many times a pass's cost). Written to ``--out`` as never-loses-<machine>-<date>.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import Engine, load_engine

import mlx.core as mx

from . import arms, batched

ROOT = Path(__file__).resolve().parent.parent
CHAT_PROMPTS = ROOT / "benchmarks" / "data" / "chat-prompts.jsonl"
SMOKE = dict(
    shape="qwen3-tiny",
    batches="2,4",
    prompts=8,
    context=32,
    max_tokens=8,
    reps=1,
    pair_batches="2",
    pair_prompts=4,
    pair_max_tokens=8,
)


def chat_prompts(count: int) -> List[str]:
    rows = [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:count]


def plain_cycle_ms(counts: Dict[int, list]) -> Any:
    """Mean milliseconds of the job's plain (T = 1) cycles, None if it ran none."""
    n, seconds, _ = counts.get(1, (0, 0.0, 0))
    return round(1e3 * seconds / n, 2) if n else None


def run_job(engine: Engine, prompts: list, max_tokens: int, B: int) -> Dict[str, Any]:
    seen = set(engine.shapes_seen)
    out = batched.run_engine(engine, prompts, max_tokens, B)
    out["plain_cycle_ms"] = plain_cycle_ms(engine.decode_counts)
    # cycles of a shape (rows, verify width, key bucket) no earlier cycle of this engine ran (each
    # shape is new to one cycle only), and of those, the cycles of a (rows, width) new at every key
    # bucket: a compiled pass sees its buffer whole, so only these trace anew
    new = sorted(engine.shapes_seen - seen)
    out["new_shape_cycles"], out["new_shapes"] = len(new), [list(shape) for shape in new]
    out["new_width_cycles"] = len({s[:2] for s in new} - {s[:2] for s in seen})
    # the drafter's prompt context, written by the first drafting cycle (none in a job decoded plainly)
    out["drafter_context"] = dict(getattr(engine, "context_counts", {}))
    return out


def side_by_side(
    arms_: Dict[str, Engine],
    prompts: list,
    max_tokens: int,
    B: int,
    reps: int,
    warm_prompts: int,
    warm_tokens: int = arms.WARM_TOKENS,
) -> Dict[str, Any]:
    """Each arm warmed up at B (a job of the first ``warm_prompts`` prompts, ``warm_tokens`` new
    tokens each), then the arms alternating for ``reps`` timed runs, in turns A B, B A, A B, ...
    (neither arm always runs first); medians."""
    warm = {
        name: run_job(engine, prompts[:warm_prompts], min(warm_tokens, max_tokens), B)
        for name, engine in arms_.items()
    }
    runs: Dict[str, list] = {name: [] for name in arms_}
    order = list(arms_.items())
    for rep in range(reps):
        for name, engine in order if rep % 2 == 0 else order[::-1]:
            runs[name].append(run_job(engine, prompts, max_tokens, B))
            arms.release()
    out: Dict[str, Any] = {}
    for name, done in runs.items():
        first = dict(done[0])
        for key in ("tok_s", "wall_s", "prefill_s"):
            first[key] = statistics.median(r[key] for r in done)
        first["tok_s_runs"] = [round(r["tok_s"], 2) for r in done]
        for key in ("new_shape_cycles", "new_width_cycles"):
            first[key + "_runs"] = [r[key] for r in done]
            first["warm_up_" + key] = warm[name][key]
        out[name] = first
    return out


def random_drafter_part(args) -> Dict[str, Any]:
    dtype = mx.float32 if args.dtype == "float32" else mx.bfloat16
    setup = arms.build_setup(args.shape, dtype, with_ar_draft=False)
    config = arms.text_config(setup.shape.target)
    # each arm its own copy of the target: an engine wraps the layers of the model it is given
    plain = Engine(setup.model, setup.tokenizer, None, config=config, prefix_cache_mb=0)
    drafting = Engine(
        arms.engine_setup(setup).model,
        setup.tokenizer,
        setup.drafter,
        config=config,
        prefix_cache_mb=0,
    )
    prompts = batched.job_prompts(args.prompts, args.context, setup.vocab_size)
    out = {}
    for B in _ints(args.batches):
        figures = side_by_side(
            {"plain": plain, "random drafter": drafting},
            prompts,
            args.max_tokens,
            B,
            args.reps,
            warm_prompts=min(2 * B, len(prompts)),
        )
        figures["ratio"] = figures["random drafter"]["tok_s"] / figures["plain"]["tok_s"]
        out[str(B)] = figures
        print(
            f"random drafter B={B}: {figures['ratio']:.3f}x plain "
            f"({figures['random drafter']['tok_s']:.1f} vs {figures['plain']['tok_s']:.1f} tok/s)",
            flush=True,
        )
    return out


def default_pair_part(args) -> Dict[str, Any]:
    with_drafter = load_engine(prefix_cache_mb=0)
    plain = load_engine(draft=None, prefix_cache_mb=0)
    prompts = chat_prompts(args.pair_prompts)
    out = {}
    for B in _ints(args.pair_batches):
        figures = side_by_side(
            {"plain": plain, "drafter": with_drafter},
            prompts,
            args.pair_max_tokens,
            B,
            args.reps,
            # the job itself: a shorter one leaves widths its budget never reaches to compile in
            # the drafter arm's first timed run (the GPU's: docs/results/never-loses.md)
            warm_prompts=len(prompts),
            warm_tokens=args.pair_max_tokens,
        )
        figures["ratio"] = figures["drafter"]["tok_s"] / figures["plain"]["tok_s"]
        out[str(B)] = figures
        print(
            f"default pair B={B}: {figures['ratio']:.3f}x plain "
            f"({figures['drafter']['tok_s']:.1f} vs {figures['plain']['tok_s']:.1f} tok/s, "
            f"{figures['drafter']['tokens_per_cycle'] or 0:.2f} tokens/cycle)",
            flush=True,
        )
    return out


def markdown(doc: Dict[str, Any]) -> str:
    lines = [f"# Never loses: {doc['machine']}, {doc['date']}", "", f"`{doc['command']}`", ""]
    for part, arm in (("random_drafter", "random drafter"), ("default_pair", "drafter")):
        if not doc.get(part):
            continue
        title = (
            f"{doc['shape']}, random drafter"
            if part == "random_drafter"
            else "default pair, chat prompts"
        )
        lines += [
            f"## {title}",
            "",
            "| B | plain tok/s | with drafter tok/s | ratio | tokens/cycle | plain cycle ms (no drafter / drafter) "
            "| cycles of new shapes, of new (rows, width), timed runs (no drafter / drafter) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for B, f in doc[part].items():
            p, d = f["plain"], f[arm]
            lines.append(
                f"| {B} | {p['tok_s']:.1f} | {d['tok_s']:.1f} | {f['ratio']:.3f}x | "
                f"{d['tokens_per_cycle'] or 0:.2f} | {p['plain_cycle_ms']} / {d['plain_cycle_ms']} | "
                f"{_new(p)} / {_new(d)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _new(figures: Dict[str, Any]) -> str:
    """'shapes, widths': the timed runs' cycles of new shapes and of new (rows, width) pairs."""
    if "new_shape_cycles_runs" not in figures:
        return "-"
    return f"{sum(figures['new_shape_cycles_runs'])}, {sum(figures['new_width_cycles_runs'])}"


def _ints(text: str) -> List[int]:
    return [int(x) for x in str(text).split(",") if x]


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
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--pair-batches", default="1,8,16,32")
    ap.add_argument("--pair-prompts", type=int, default=32)
    ap.add_argument("--pair-max-tokens", type=int, default=64)
    ap.add_argument("--no-default-pair", action="store_true")
    ap.add_argument("--no-random-drafter", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny shape and job: checks the harness, measures nothing",
    )
    ap.add_argument("--machine", default=platform.node() or "machine")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    arms.apply_smoke(args, SMOKE)
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    doc = {
        "machine": args.machine,
        "date": date,
        "shape": args.shape,
        "dtype": args.dtype,
        "mlx": mx.__version__,
        "command": "python -m benchmarks.never_loses "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "smoke": args.smoke,
    }
    if not args.no_random_drafter:
        doc["random_drafter"] = random_drafter_part(args)
    if not args.no_default_pair:
        doc["default_pair"] = default_pair_part(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"never-loses-{args.machine}-{date}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return path


if __name__ == "__main__":
    main()
