"""Two checkouts of dflash_batch side by side, one sitting: did a restructuring cost speed?

    python -m benchmarks.checkout_ab --before /tmp/before --after . --runs 5 --out docs/results

Each run starts a fresh process per checkout (``PYTHONPATH`` points at it, so its
``dflash_batch`` is the one imported), loads the embedded default pair through the public
``load_engine`` and times two jobs on the same short chat prompts (benchmarks/data): batch 1 and
one batch of all the prompts, each after a warm-up job of the same shape in that process. The
checkouts take turns going first (A B, B A, ...), so a load that comes and goes falls on both.
Reported: each checkout's median whole-job tok/s per job and the ratio after / before; written
to ``--out`` as checkout-ab-<machine>-<date>.json and .md.

Only the public API is used (``load_engine``, ``Engine.generate_batch``, ``Completion.token_ids``),
so any two commits that have it can be compared.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
CHAT_PROMPTS = ROOT / "benchmarks" / "data" / "chat-prompts.jsonl"

# Runs in the child process, inside the checkout under test: one line of JSON per job.
CHILD = """
import json, sys, time
import dflash_batch.engine as engine
prompts, max_tokens, batch = json.loads(sys.stdin.read())
eng = engine.load_engine()
out = {"module": engine.__file__}
for name, size in (("batch-1", 1), ("batched", batch)):
    eng.generate_batch(prompts, max_tokens=max_tokens, batch_size=size)  # warm-up: same job
    started = time.perf_counter()
    done = eng.generate_batch(prompts, max_tokens=max_tokens, batch_size=size)
    seconds = time.perf_counter() - started
    out[name] = sum(len(c.token_ids) for c in done) / seconds
print(json.dumps(out))
"""


def chat_prompts(count: int) -> List[str]:
    rows = [json.loads(line) for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows[:count]]


def run_checkout(tree: Path, prompts: List[str], max_tokens: int, batch: int) -> Dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps([prompts, max_tokens, batch]),
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["module"].startswith(str(tree.resolve())):
        raise SystemExit(f"{tree}: imported {result['module']}, not this checkout")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="the checkout before (a folder)")
    parser.add_argument(
        "--after", type=Path, default=ROOT, help="the checkout after (default: this one)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--machine", default="cpu-2core")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    prompts = chat_prompts(args.prompts)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: Dict[str, List[Dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.runs):
        for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
            runs[name].append(run_checkout(trees[name], prompts, args.max_tokens, len(prompts)))
            print(
                name,
                {k: round(v, 1) for k, v in runs[name][-1].items() if k != "module"},
                flush=True,
            )
    table = {}
    for job in ("batch-1", "batched"):
        med = {name: statistics.median(r[job] for r in runs[name]) for name in runs}
        table[job] = {
            "before": med["before"],
            "after": med["after"],
            "ratio": med["after"] / med["before"],
            "before_runs": [round(r[job], 2) for r in runs["before"]],
            "after_runs": [round(r[job], 2) for r in runs["after"]],
        }
    command = "python -m benchmarks.checkout_ab " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "machine": args.machine,
        "date": dt.date.today().isoformat(),
        "platform": platform.platform(),
        "command": command,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "trees": {k: str(v) for k, v in trees.items()},
        "jobs": table,
    }
    lines = [
        f"`{command}` ({args.machine}, {result['date']}; {len(prompts)} chat prompts, "
        f"{args.max_tokens} new tokens, median of {args.runs} runs, whole-job tok/s)",
        "",
        "| job | before | after | after / before | runs before | runs after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for job, row in table.items():
        lines.append(
            f"| {job} | {row['before']:.1f} | {row['after']:.1f} | {row['ratio']:.3f}x | "
            f"{row['before_runs']} | {row['after_runs']} |"
        )
    print("\n".join(lines))
    if args.out is not None:
        stem = args.out / f"checkout-ab-{args.machine}-{result['date']}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
