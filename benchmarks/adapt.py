"""A job that adapts its drafter mid-way (issue 39): tokens per cycle and whole-job time on the
rows after the switch, against the same rows drafted by the job's own (shipped) drafter.

    python -m benchmarks.adapt --out docs/results/adapt-<machine>.json          # the default pair
    python -m benchmarks.adapt --smoke --target TINY --draft TINY_DRAFTER         # seconds, CPU

The prompts are a synthetic product-catalogue domain (``catalogue_prompts``: made-up products,
materials and buyers, with copywriting and customer-service tasks), built from word lists of
this file alone: the shipped drafter's training read the standard library's docstrings, code
and pydoc topics, ``training/prompts.py``'s templates and the target's self-written turns
(its TRAINING.md), none of which this is.

One engine, one job, in four timed phases: the first ``--adapt-after`` rows with the shipped
drafter; ``adapt`` on them (``--time-budget``); the later rows with the drafter in force then (the
adapted one if it was kept); the same later rows again, as a second job, with the shipped
drafter. The whole job with adaptation is phases 1 + 2 + 3, without it phases 1 + 4. Every cycle
verifies the whole block unless ``--adaptive`` (then the engine picks widths, as a job's does).
Greedy: both runs of the later rows are checked equal token for token.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx)
from dflash_batch.engine import load_engine

import mlx.core as mx

from benchmarks.default_pair import command_line, write_result
from dflash_batch.runner import drafters
from dflash_batch.runner.execution import run_job
from dflash_batch.runner.jobs import create_job
from dflash_batch.runner.spec import load_spec
from dflash_batch.training.adapt import adapt_job

PRODUCTS = ["walnut cutting board", "linen apron", "brass desk lamp", "wool throw blanket", "enamel camping mug",
            "bamboo laundry basket", "cast iron skillet", "felt slippers", "glass spice jars", "canvas tote bag",
            "copper watering can", "leather card holder", "stoneware planter", "oak wall shelf", "cotton bath robe",
            "steel lunch box", "rattan pendant shade", "cork yoga block", "silk pillowcase", "pine bird feeder"]  # fmt: skip
FINISHES = [
    "matte black",
    "sage green",
    "natural",
    "terracotta",
    "ivory",
    "charcoal",
    "mustard",
    "navy",
    "rose",
]
BUYERS = ["a first apartment", "a busy parent", "a student on a budget", "a keen gardener", "a small café",
          "a wedding gift", "someone who travels often", "a home office", "a child's room", "a weekend cabin"]  # fmt: skip
TASKS = [
    "Write a two-sentence product description for a {finish} {product}, aimed at {buyer}.",
    "List three selling points of our {finish} {product} for {buyer}.",
    "A customer asks whether the {finish} {product} is easy to clean. Write a friendly reply.",
    "Write a short customer review of a {finish} {product} bought for {buyer}.",
    "Write a one-line headline for a sale on the {finish} {product}.",
    "Explain how to care for a {product} so it lasts for years.",
    "A customer says their {product} arrived damaged. Write a polite reply offering a replacement.",
    "Suggest two other products that go well with a {finish} {product} for {buyer}.",
    "Write a short gift note to go with a {finish} {product} for {buyer}.",
    "Compare the {finish} and the {other} {product} in two sentences.",
]


def catalogue_prompts(n: int, seed: int = 0) -> list:
    """``n`` distinct prompts of the catalogue domain, in a seeded order."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        finish, other = rng.sample(FINISHES, 2)
        text = rng.choice(TASKS).format(
            product=rng.choice(PRODUCTS), finish=finish, other=other, buyer=rng.choice(BUYERS)
        )
        if text not in seen:
            seen.add(text)
            out.append({"id": f"c{len(out):05d}", "prompt": text})
        if len(seen) >= len(TASKS) * len(PRODUCTS) * len(FINISHES) * len(BUYERS):
            raise ValueError(f"the catalogue domain has fewer than {n} distinct prompts")
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pooled(rows: list) -> dict:
    """Committed tokens per verify cycle over ``rows`` (the bonus token in, the prefill's out)."""
    committed = sum(k * c for r in rows for k, c in enumerate(r["acceptance_histogram"] or []))
    cycles = sum(r["verify_cycles"] or 0 for r in rows)
    return {"rows": len(rows), "cycles": cycles, "tokens_per_cycle": committed / cycles if cycles else None,
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in rows)}  # fmt: skip


def timed_run(record, engine, chunks) -> float:
    start = time.perf_counter()
    result = run_job(record, chunks, lambda spec: drafters.use_in_force(engine, record))
    mx.synchronize()
    if result.stopped or result.errors:
        raise RuntimeError(f"job {record.id}: chunks {chunks} stopped or failed ({result})")
    return time.perf_counter() - start


def rows_by_id(record) -> dict:
    return {r["id"]: r for r in record.store().read().to_pylist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="default: the embedded default pair")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--adapt-after", type=int, default=512, help="rows finished before adapting")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--batch", type=int, default=64, help="rows decoded at once (and the chunk size)"
    )
    ap.add_argument(
        "--time-budget", type=float, default=300.0, help="seconds of adaptation training"
    )
    ap.add_argument(
        "--steps", type=int, default=0, help="adaptation steps (0: fill the time budget)"
    )
    ap.add_argument("--adaptive", action="store_true", help="let the engine pick verify widths")
    ap.add_argument("--home", help="job home (default: a temporary folder)")
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny run: 24 prompts, 12 tokens, 4 steps"
    )
    ap.add_argument("--out", help="also write the result JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.adapt_after, args.max_tokens, args.batch, args.steps = 24, 16, 12, 8, 4
    if not 0 < args.adapt_after < args.prompts or args.adapt_after % args.batch:
        ap.error("--adapt-after must be a multiple of --batch, above 0 and below --prompts")
    with tempfile.TemporaryDirectory() as tmp:
        return run(args, Path(args.home or tmp), argv)


def run(args, home: Path, argv) -> int:
    engine = load_engine(args.target, args.draft, adaptive_block=args.adaptive)
    if engine.drafter is None:
        print("no drafter: nothing to adapt", file=sys.stderr)
        return 2
    prompts = catalogue_prompts(args.prompts)
    later = prompts[args.adapt_after :]
    home.mkdir(parents=True, exist_ok=True)
    common = dict(target=args.target, draft=args.draft, max_tokens=args.max_tokens, chunk_size=args.batch,
                  batch_size=args.batch)  # fmt: skip
    job = create_job(
        load_spec(write_jsonl(home / "job.jsonl", prompts), output_dir=str(home / "job"), **common),
        home,
    )
    shipped = create_job(
        load_spec(
            write_jsonl(home / "later.jsonl", later), output_dir=str(home / "later"), **common
        ),
        home,
    )
    first = args.adapt_after // args.batch
    times = {"first_rows_s": timed_run(job, engine, list(range(first)))}
    start = time.perf_counter()
    with drafters.adapt_lock(job):
        entry = adapt_job(job, time_budget=args.time_budget, steps=args.steps, min_rows=min(64, args.adapt_after),
                          log=lambda m: print(f"adapt: {m}", file=sys.stderr, flush=True))  # fmt: skip
    times["adapt_s"] = time.perf_counter() - start
    times["later_rows_adapted_s"] = timed_run(job, engine, list(range(first, job.chunks)))
    times["later_rows_shipped_s"] = timed_run(shipped, engine, list(range(shipped.chunks)))
    rows, base = rows_by_id(job), rows_by_id(shipped)
    mismatched = [
        p["id"] for p in later if rows[p["id"]]["token_ids"] != base[p["id"]]["token_ids"]
    ]
    adapted = pooled([rows[p["id"]] for p in later])
    plain = pooled([base[p["id"]] for p in later])
    with_adapt = times["first_rows_s"] + times["adapt_s"] + times["later_rows_adapted_s"]
    without = times["first_rows_s"] + times["later_rows_shipped_s"]
    result = {
        "command": command_line("adapt", argv),
        "device": str(mx.default_device()), "mlx": mx.__version__, "engine": engine.description,
        "prompts": len(prompts), "adapt_after": args.adapt_after, "max_tokens": args.max_tokens, "batch": args.batch,
        "adaptive_block": args.adaptive, "adaptation": {k: v for k, v in entry.items() if k not in ("eval_before", "eval_after")},
        "first_rows_shipped": pooled([rows[p["id"]] for p in prompts[: args.adapt_after]]),
        "later_rows_adapted": adapted, "later_rows_shipped": plain,
        "tokens_per_cycle_ratio": (adapted["tokens_per_cycle"] / plain["tokens_per_cycle"]
                                   if adapted["tokens_per_cycle"] and plain["tokens_per_cycle"] else None),
        "times_s": {k: round(v, 3) for k, v in times.items()},
        "whole_job_s": {"with_adaptation": round(with_adapt, 3), "shipped_drafter": round(without, 3),
                        "speedup": round(without / with_adapt, 4)},
        "later_rows_token_exact": not mismatched, "mismatched_ids": mismatched[:10],
    }  # fmt: skip
    write_result(result, args.out)
    return 0 if not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
