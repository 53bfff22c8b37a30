"""Time the README's main job, ``dflash-batch run examples/prompts.jsonl``, with the drafter and
with ``--no-draft``, as the user sees it: each run is a fresh process (imports, model load,
warm-up and the job), the two arms alternating, median of ``--runs`` runs per arm.

    .venv/bin/python benchmarks/readme_job.py --runs 3

Each child runs the job through the same path as ``dflash-batch run`` (``api.run`` with the
default engine factory, a throw-away home) and reports its parts:

    start     process start to the job's start: interpreter, imports, spec and job set-up
    load      ``load_engine`` (the default pair from its local copy)
    warm-up   ``Engine.warm_up`` (the cost model's timed passes; 0 with --no-draft)
    decode    the job less its warm-up: prefill, decode cycles, writing results
    whole     the child's wall time, measured by this process (what the user waits for)

plus its decode cycles per verify width (``{T: [cycles, seconds, rows summed]}``). The greedy
outputs of the two arms must be identical (checked: the drafter changes speed, never text).
``ratio`` = median whole (--no-draft) / median whole (drafter): >= 1 means the drafter pays;
``pair_ratios``: the same for each pair of runs that ran back to back (a shared machine's load
drifts). ``--from FILE`` summarises the runs an earlier ``--out`` saved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "examples" / "prompts.jsonl"
ARMS = ("draft", "no-draft")
PARTS = ("start", "load", "warm-up", "decode", "whole")


def child(arm: str, home: str, started: float) -> dict:
    """One run of the job in this process (``started``: the parent's clock when it spawned us)."""
    from dflash_batch import api

    job_started = time.time()
    timed = {"load": 0.0, "warm-up": 0.0}
    engines = []

    def factory(**model):
        t = time.perf_counter()
        engine = api.load_model(**model)
        timed["load"] += time.perf_counter() - t
        warm_up = engine.warm_up

        def timed_warm_up(*args, **kwargs):  # the cost model's passes, timed from outside
            t = time.perf_counter()
            try:
                return warm_up(*args, **kwargs)
            finally:
                timed["warm-up"] += time.perf_counter() - t

        engine.warm_up = timed_warm_up
        engines.append(engine)
        return engine

    t = time.perf_counter()
    job = api.run(
        str(PROMPTS),
        engine_factory=factory,
        home=home,
        name=arm.replace("-", ""),
        **({"draft": "none"} if arm == "no-draft" else {}),
    )
    job_s = time.perf_counter() - t
    rows = job.to_pandas().sort_values("id")
    counts = getattr(engines[0], "decode_counts", {}) if engines else {}
    return {
        "arm": arm,
        "start": job_started - started,
        "load": timed["load"],
        "warm-up": timed["warm-up"],
        "decode": job_s - timed["load"] - timed["warm-up"],
        "state": job.status()["state"],
        "cycles": {
            str(T): [int(c[0]), round(c[1], 4), int(c[2])] for T, c in sorted(counts.items())
        },
        "outputs": dict(zip(rows["id"], rows["output"])),
    }


def run_once(arm: str) -> dict:
    """A fresh process running the job; its wall time is ``whole``."""
    with tempfile.TemporaryDirectory(prefix="readme-job-") as home:
        started = time.time()
        done = subprocess.run(
            [sys.executable, __file__, "--child", arm, "--home", home, "--started", repr(started)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, DFLASH_BATCH_HOME=home),
        )
        whole = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"{arm} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["whole"] = whole
    return out


def summary(runs: list) -> dict:
    """Medians per arm and part, the ratio, and whether the arms' outputs are identical."""
    med = {
        arm: {p: statistics.median(r[p] for r in runs if r["arm"] == arm) for p in PARTS}
        for arm in ARMS
    }
    outputs = {json.dumps(r["outputs"], sort_keys=True) for r in runs}
    # run i of each arm ran back to back with the other's run i: the ratio of each such pair
    pairs = list(zip(*([r["whole"] for r in runs if r["arm"] == arm] for arm in ARMS)))
    return {
        "median_s": {arm: {p: round(v, 3) for p, v in parts.items()} for arm, parts in med.items()},
        "ratio": round(med["no-draft"]["whole"] / med["draft"]["whole"], 3),
        "pair_ratios": [round(plain / draft, 3) for draft, plain in pairs],
        # the job less the model's load: the drafter's warm-up counted with its decoding
        "ratio_decode": round(
            med["no-draft"]["decode"] / (med["draft"]["decode"] + med["draft"]["warm-up"]), 3
        ),
        "outputs_identical": len(outputs) == 1,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=3, help="runs per arm (median)")
    ap.add_argument("--out", help="also write the runs and the summary here (JSON)")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--home", help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, help=argparse.SUPPRESS)
    ap.add_argument(
        "--from", dest="saved", help="summarise the runs saved in this --out file instead"
    )
    args = ap.parse_args(argv)
    if args.saved:
        print(json.dumps(summary(json.loads(Path(args.saved).read_text())["runs"]), indent=1))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.home, args.started)))
        return 0
    runs = []
    for i in range(args.runs):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:  # alternating, each arm first in turn
            r = run_once(arm)
            runs.append(r)
            parts = "  ".join(f"{p} {r[p]:.2f}" for p in PARTS)
            print(
                f"run {i + 1} {arm:<8}  {parts}  cycles {r['cycles']}", file=sys.stderr, flush=True
            )
    result = summary(runs)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": result}, indent=1))
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
