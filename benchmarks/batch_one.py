"""Batch 1 on the default pair, cycle by cycle: ``python -m benchmarks.batch_one``.

Why the adaptive verify width drafts as often as it does at batch 1. Per held-out prompt (after a
warm-up run each, whose cycles are logged as run -1), median of ``--runs``: decode tok/s of ``mlx_lm.stream_generate``, of the
default engine (adaptive width), of the engine verifying the whole block every cycle and of
the engine without a drafter. For the adaptive engine, every cycle of the timed runs: its
width T, its seconds, whether the engine learnt from it (a cycle of shapes not run before
includes compiling them and is not learnt from), the drafter context rows it packed, and what
the cost model predicted for it. At the end, the cost model: the fitted passes, the timed
widths and the learnt excess per cycle kind.

On a CPU only ratios mean anything; on a GPU at batch 1 a pass of a 135 M target is a few
milliseconds, mostly launches, so the widths cost about the same and the host work counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine import load_engine, load_target, pick_dtype
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.ops import compiled, matmul
from dflash_batch.engine.widths import CostModel

import mlx.core as mx

from .default_pair import (
    command_line,
    held_out_options,
    held_out_prompts,
    run_engine,
    run_mlx_lm,
    write_result,
)


@contextmanager
def cycle_log(log: list):
    """Record every ``BatchDecoder.run`` cycle into ``log`` while inside."""
    original, observe = BatchDecoder.run, CostModel.observe
    observed = [0]

    def counted(self, B, T, seconds):
        observed[0] += 1
        observe(self, B, T, seconds)

    def run(self, width):
        pending = sum(self.pending_counts)
        cost = self.width_policy.cost
        live = sum(r is not None for r in self.rows)
        predicted = cost.cycle(live, width)
        before = observed[0]
        started = time.perf_counter()
        steps = original(self, width)
        seconds = time.perf_counter() - started
        log.append(
            {
                "T": width,
                "ms": round(seconds * 1e3, 3),
                "predicted_ms": round(predicted * 1e3, 3),
                "learnt": observed[0] > before,
                "context_rows": pending,
                "committed": sum(len(s.tokens) for s in steps if s is not None),
            }
        )
        return steps

    BatchDecoder.run, CostModel.observe = run, counted
    try:
        yield
    finally:
        BatchDecoder.run, CostModel.observe = original, observe


def summary(log: list) -> dict:
    """Per width: cycles, median ms, tokens per cycle; and the share of cycles that drafted."""
    widths = {}
    for c in log:
        widths.setdefault(c["T"], []).append(c)
    out = {}
    for T, cs in sorted(widths.items()):
        out[T] = {
            "cycles": len(cs),
            "median_ms": round(statistics.median(c["ms"] for c in cs), 3),
            "median_predicted_ms": round(statistics.median(c["predicted_ms"] for c in cs), 3),
            "tokens_per_cycle": round(sum(c["committed"] for c in cs) / len(cs), 3),
            "not_learnt": sum(not c["learnt"] for c in cs),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    held_out_options(ap, prompts=6, max_tokens=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--matmul-ab",
        action="store_true",
        help="also the adaptive engine and the whole block with few-row products the other way than "
        "the default (engine/ops/matmul.py: the kernel on CUDA, MLX's matmul elsewhere), each an "
        "engine of its own, named adaptive_<mode>_matmul, whole_block_<mode>_matmul and "
        "no_draft_<mode>_matmul",
    )
    ap.add_argument(
        "--passes-ab",
        action="store_true",
        help="likewise with decoding passes the other way than the default (engine/ops/compiled.py: "
        "compiled on CUDA, eager elsewhere): adaptive_<mode>_passes, ...",
    )
    args = ap.parse_args(argv)

    adaptive = load_engine(args.target, args.draft or "auto")
    fixed = load_engine(args.target, args.draft or "auto", adaptive_block=False)
    plain = load_engine(args.target, None)
    folder = adaptive.description["target"]
    if args.target is None:
        from dflash_batch.engine.models.default_model import ensure_default_pair

        folder = ensure_default_pair()[0]
    ref, tokenizer, _ = load_target(folder, None, pick_dtype("auto"))
    prompts = held_out_prompts(tokenizer, args.prompts, args.samples)
    arms = {
        "mlx_lm": lambda p: run_mlx_lm(ref, tokenizer, p, args.max_tokens)[:2],
        "adaptive": lambda p: run_engine(adaptive, p, args.max_tokens)[:2],
        "whole_block": lambda p: run_engine(fixed, p, args.max_tokens)[:2],
        "no_draft": lambda p: run_engine(plain, p, args.max_tokens)[:2],
    }
    ab = []
    if args.matmul_ab:
        ab.append(("matmul", "stock" if matmul.default_mode() == "kernel" else "kernel"))
    if args.passes_ab:
        ab.append(("passes", "eager" if compiled.default_mode() == "compiled" else "compiled"))
    for kind, other in ab:
        modes = {kind: other}
        for name, engine in (
            (f"adaptive_{other}_{kind}", load_engine(args.target, args.draft or "auto", **modes)),
            (
                f"whole_block_{other}_{kind}",
                load_engine(args.target, args.draft or "auto", adaptive_block=False, **modes),
            ),
            (f"no_draft_{other}_{kind}", load_engine(args.target, None, **modes)),
        ):
            arms[name] = lambda p, engine=engine: run_engine(engine, p, args.max_tokens)[:2]
    log: list = []
    rows = []
    for i, p in enumerate(prompts):
        tps = {name: [] for name in arms}
        for run in range(-1, args.runs):  # run -1: the warm-up, logged but not timed
            for name, arm in arms.items():
                if name == "adaptive":
                    start = len(log)
                    with cycle_log(log):
                        ids, rate = arm(p["prompt"])
                    for c in log[start:]:
                        c["prompt"], c["run"] = i, run
                else:
                    ids, rate = arm(p["prompt"])
                if run >= 0:
                    tps[name].append(rate)
        row = {"id": p["id"], "tokens": len(ids)} | {
            name: round(statistics.median(v), 2) for name, v in tps.items()
        }
        rows.append(row)
        print(row, file=sys.stderr)

    def ratio(name):
        return round(statistics.median(r[name] / r["mlx_lm"] for r in rows), 3)

    cost = adaptive.cost.get(1)
    result = {
        "command": command_line("batch_one", argv),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "prompts": rows,
        "median_speedup": {name: ratio(name) for name in arms if name != "mlx_lm"},
        "adaptive_widths": summary([c for c in log if c["run"] >= 0]),
        "cost_model": None
        if cost is None
        else {
            "target_ms": {"t0": cost.t0 * 1e3, "t1": cost.t1 * 1e3, "t2": cost.t2 * 1e3},
            "draft_ms": {"d0": cost.d0 * 1e3, "d1": cost.d1 * 1e3},
            "timed_ms": {T: s * 1e3 for T, s in cost.timed.items()},
            "excess_ms": {
                ("drafting" if k else "plain"): [round(x * 1e3, 3) for x in v]
                for k, v in cost.excess.items()
            },
        },
        "cycles": log,
    }
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
