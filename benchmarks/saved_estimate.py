"""What speculation saved, checked: a job's estimate of plain decoding against a real run of the
same job without the drafter.

    python -m benchmarks.saved_estimate --out docs/results/saved-estimate.md     # CPU: the default pair
    python -m benchmarks.saved_estimate --shape qwen3-4b --dtype bfloat16 --prompts 128 --batch 64 \\
        --max-tokens 128 --out docs/results/saved-estimate-gpu.md                # GPU: Qwen3-4B shape
    python -m benchmarks.saved_estimate --smoke                                  # a tiny random pair

Both arms go through the runner (``dflash_batch.run`` with the loaded engine: the job loop of
``dflash-batch run``); the plain arm's engine is loaded without a drafter, as ``--no-draft`` loads
it. The prompts are short chat instructions (benchmarks/runner.py), greedy, ``--max-tokens`` each,
at batch size ``--batch``. Each arm runs the job once untimed (compilation; the drafter engine's
pass costs at this batch size), then ``--runs`` rounds of both arms in turn. Per round:

    estimate   plain_seconds_est summed over the drafted job's rows (its control rows left out)
    real       decode_share_s summed over the same rows of the plain job: its decode cycles' time
    error      estimate / real - 1                                       (the goal: within 10%)
    speedup    estimated: estimate / the drafted rows' decode time; real: real / the same

with the medians over the rounds, each arm's whole-job output tok/s, the control rows' measured
rate where ``--control`` is given, and whether both arms wrote the same text. Writes JSON, and
Markdown with ``--out PATH.md`` (the JSON beside it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)

import mlx.core as mx

GOAL = 0.10  # the estimate within 10% of the real plain run


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument(
        "--draft", default="auto", help="drafter folder (default: the target's registered one)"
    )
    ap.add_argument(
        "--shape",
        help="a random-weight pair of benchmarks/shapes.py instead (saved to a temp folder)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3, help="rounds of both arms after their warm-up")
    ap.add_argument("--control", type=float, default=0.0, help="the drafted job's --control share")
    ap.add_argument("--machine", default=platform.node() or "unknown")
    ap.add_argument("--out", help="write Markdown here (and JSON beside it)")
    ap.add_argument(
        "--smoke", action="store_true", help="a tiny random pair, 4 prompts of 8 tokens, one round"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape = args.shape or "qwen3-tiny"
        args.prompts, args.max_tokens, args.batch, args.runs = 4, 8, 4, 1
        args.dtype = "float32"
        args.control = args.control or 0.5
    return args


def load_pair(args, work: Path):
    """(engine with its drafter, engine without): the pair named, a saved shape, or the default."""
    from dflash_batch.engine import load_engine

    target, draft = args.target, args.draft
    if args.shape:
        from .model_files import save_pair

        dtype = "float32" if args.dtype == "auto" else args.dtype
        paths = save_pair(work / "pair", args.shape, dtype)
        target, draft = paths["target"], paths["draft"]
    drafted = load_engine(target, draft, dtype=args.dtype)
    if drafted.drafter is None:
        raise SystemExit("the target has no drafter: nothing to compare")
    return drafted, load_engine(
        drafted.description["target"] if target is None else target, None, dtype=args.dtype
    )


def run_arm(engine, src: Path, work: Path, name: str, args, control: float) -> Dict[str, Any]:
    """One job through the runner into a fresh folder: its rows and wall time."""
    from dflash_batch import api

    from .runner import fresh

    fresh(engine)
    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{name}-"))
    mx.synchronize()
    start = time.perf_counter()
    job = api.run(src, engine=engine, home=work / "home", max_tokens=args.max_tokens, batch_size=args.batch,
                  output_dir=str(out), control=control or None)  # fmt: skip
    wall = time.perf_counter() - start
    rows = {r["id"]: r for r in job.to_arrow().to_pylist()}
    if any(r["status"] != "ok" for r in rows.values()):
        raise SystemExit(f"{name}: error rows in {out}")
    return {
        "rows": rows,
        "wall_s": wall,
        "speculation": job.speculation(),
        "cycles": cycles(engine, args.batch),
    }


def cycles(engine, batch: int) -> Dict[str, Any]:
    """Where the figures come from: the job's cycles per verify width (count, seconds, rows in
    flight summed, mean seconds a cycle) and the cost model's plain cycle at a few batch sizes."""
    counts = {T: {"cycles": n, "seconds": round(s, 4), "rows": rows, "mean_s": round(s / n, 5)}
              for T, (n, s, rows) in sorted(engine.decode_counts.items())}  # fmt: skip
    cost = engine.cost.get(batch) or engine.cost_model
    if engine.drafter is None or cost is None:
        return {"by_width": counts}
    model = {B: round(cost.cycle(B, 1), 5) for B in sorted({1, max(batch // 2, 1), batch})}
    trusted = {f"{B}x{T}": len(v) for (B, T), v in cost.width_excess.items()}
    return {
        "by_width": counts,
        "model_plain_cycle_s": model,
        "timed": cost.timed,
        "cycles_seen": trusted,
    }


def compare(drafted: Dict[str, Any], plain: Dict[str, Any]) -> Dict[str, Any]:
    """One round's figures (module doc)."""
    mine = [r for r in drafted["rows"].values() if not r["control"]]
    decode = sum(r["decode_share_s"] for r in mine)
    estimate = sum(r["plain_seconds_est"] for r in mine)
    real = sum(plain["rows"][r["id"]]["decode_share_s"] for r in mine)
    tokens = sum(r["completion_tokens"] for r in drafted["rows"].values())
    same = all(r["output"] == plain["rows"][i]["output"] for i, r in drafted["rows"].items())
    return {
        "rows": len(mine),
        "drafted_decode_s": decode,
        "estimate_s": estimate,
        "real_plain_s": real,
        "error": estimate / real - 1,
        "speedup_estimated": estimate / decode,
        "speedup_real": real / decode,
        "drafted_tok_s": tokens / drafted["wall_s"],
        "plain_tok_s": tokens / plain["wall_s"],
        "control_rows": drafted["speculation"]["control_rows"],
        "control_tokens_per_s": drafted["speculation"]["control_tokens_per_s"],
        "plain_tokens_per_s_real": sum(max(r["completion_tokens"] - 1, 0) for r in mine) / real,
        "plain_tokens_per_s_est": drafted["speculation"]["plain_tokens_per_s_est"],
        "outputs_identical": same,
        "cycles": {"drafted": drafted["cycles"], "plain": plain["cycles"]},
    }


def medians(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
    out = {}
    for key, value in rounds[0].items():
        if key == "cycles":
            continue
        values = [r[key] for r in rounds if r[key] is not None]
        if isinstance(value, bool):
            out[key] = all(r[key] for r in rounds)
        elif values:
            out[key] = statistics.median(values)
        else:
            out[key] = None
    return out


def markdown(result: Dict[str, Any]) -> str:
    m = result["median"]
    lines = [
        "# What speculation saved: the estimate against a real plain run",
        "",
        f"{result['date']}, machine `{result['machine']}` ({result['device']}), "
        f"load average {result['load_before']} before and {result['load_after']} after.",
        "",
        f"    {result['command']}",
        "",
        f"{result['setup']}",
        "",
        "| round | drafted decode s | estimated plain s | real plain s | error | speedup est. | speedup real |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(result["rounds"] + [m]):
        name = "median" if i == len(result["rounds"]) else str(i + 1)
        lines.append(
            f"| {name} | {r['drafted_decode_s']:.2f} | {r['estimate_s']:.2f} | {r['real_plain_s']:.2f} | "
            f"{r['error']:+.1%} | {r['speedup_estimated']:.2f}x | {r['speedup_real']:.2f}x |"
        )
    within = abs(m["error"]) <= GOAL
    lines += [
        "",
        f"Median error {m['error']:+.1%}: {'within' if within else 'NOT within'} the goal of {GOAL:.0%}. "
        f"Whole job, output tok/s: {m['drafted_tok_s']:.1f} with the drafter, {m['plain_tok_s']:.1f} "
        f"without. Same text in both arms: {m['outputs_identical']}.",
    ]
    if m["control_rows"]:
        lines.append(
            f"Control rows ({m['control_rows']:.0f}): {m['control_tokens_per_s']:.1f} tok/s measured in the "
            f"drafting batch; plain decoding {m['plain_tokens_per_s_est']:.1f} estimated, "
            f"{m['plain_tokens_per_s_real']:.1f} real."
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> Dict[str, Any]:
    args = parse(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        drafted_engine, plain_engine = load_pair(args, work)
        from .runner import job_prompts, job_row

        src = work / "job.jsonl"
        src.write_text("".join(job_row(i, p) for i, p in enumerate(job_prompts(args.prompts))))
        run_arm(drafted_engine, src, work, "warm-drafted", args, args.control)
        run_arm(plain_engine, src, work, "warm-plain", args, 0.0)
        rounds = []
        for n in range(args.runs):
            drafted = run_arm(drafted_engine, src, work, f"drafted-{n}", args, args.control)
            plain = run_arm(plain_engine, src, work, f"plain-{n}", args, 0.0)
            rounds.append(compare(drafted, plain))
            print(json.dumps(rounds[-1]), file=sys.stderr)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": args.machine,
        "device": str(mx.default_device()),
        "command": "python -m benchmarks.saved_estimate "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "setup": (
            f"{args.prompts} short chat prompts, {args.max_tokens} new tokens each, greedy, batch size "
            f"{args.batch}, pair: {args.shape or args.target or 'the embedded default pair'}; each arm warmed "
            f"up with one untimed job, then {args.runs} round(s) of both arms in turn"
            + (f"; the drafted job with --control {args.control}" if args.control else "")
        ),
        "load_before": round(load_before, 1),
        "load_after": round(os.getloadavg()[0], 1),
        "rounds": rounds,
        "median": medians(rounds),
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(result))
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
