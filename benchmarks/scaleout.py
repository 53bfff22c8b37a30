"""Scale-out: one job on 1 worker, then on N workers (one per GPU, pinned with ``--device``), each
worker a real ``dflash-batch worker`` process with its own resident engine on one queue.

    python -m benchmarks.scaleout --devices 0,1 --target mlx-community/Qwen3-4B-bf16 --draft auto
    python -m benchmarks.scaleout --workers 2            # CPU: a tiny seeded pair, ratios only

For each worker count: fresh home, workers started and their engines loaded (not timed), the job
submitted, timed until every chunk is committed. Reports rows/s and output tok/s, the speedup of
N workers over 1, how many chunks each worker ran, and checks every id was written exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]


def tiny_pair(folder: Path) -> Dict[str, str]:
    """A seeded tiny target and drafter saved in the real formats (as the tests build them)."""
    from dflash_batch.engine import synthetic

    cfg = synthetic.tiny_qwen3_config()
    synthetic.save_target(folder / "target", cfg, seed=0)
    synthetic.save_drafter(folder / "draft", synthetic.drafter_config(cfg, block_size=8), seed=1)
    return {"target": str(folder / "target"), "draft": str(folder / "draft")}


def write_prompts(path: Path, rows: int) -> Path:
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"row-{i:05d}", "prompt": f"Item {i}: write a short note about the number {i}."}) + "\n")
    return path


def start_worker(home: Path, log: Path, model: Dict[str, str], device: Optional[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "dflash_batch.cli", "--home", str(home), "worker", "--no-periodic",
            "--target", model["target"], "--draft", model["draft"]]  # fmt: skip
    if device is not None:
        args += ["--device", device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def one_run(root: Path, n_workers: int, devices: List[Optional[str]], model, args) -> Dict[str, object]:
    import pandas as pd

    import dflash_batch

    home = root / f"home-{n_workers}"
    logs = [root / f"worker-{n_workers}-{i}.log" for i in range(n_workers)]
    procs = [start_worker(home, logs[i], model, devices[i % len(devices)]) for i in range(n_workers)]
    try:
        wait_for(lambda: all("engine ready" in p.read_text(errors="replace") for p in logs if p.exists())
                 and all(p.exists() for p in logs), args.load_timeout, "the workers' engines")  # fmt: skip
        started = time.perf_counter()
        job = dflash_batch.submit(root / "prompts.jsonl", home=home, target=model["target"], draft=model["draft"],
                                  max_tokens=args.max_tokens, chunk_size=args.chunk_size)  # fmt: skip
        status = job.wait(timeout=args.timeout, poll=0.1)
        elapsed = time.perf_counter() - started
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
    df = pd.read_parquet(job.output_dir)
    exactly_once = len(df) == args.rows and df["id"].is_unique
    tokens = int(df["completion_tokens"].sum())
    return {
        "workers": n_workers,
        "devices": [devices[i % len(devices)] for i in range(n_workers)],
        "state": status["state"],
        "seconds": round(elapsed, 3),
        "rows_per_s": round(args.rows / elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "chunks_per_worker": [log.read_text(errors="replace").count(" generated (") for log in logs],
        "every_id_exactly_once": bool(exactly_once),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", help="comma-separated GPU indices, one worker each (e.g. 0,1)")
    p.add_argument("--workers", type=int, default=2, help="workers without --devices (CPU: default 2)")
    p.add_argument("--target", help="model (default: a tiny seeded pair built here)")
    p.add_argument("--draft", default="auto")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--load-timeout", type=float, default=900)
    p.add_argument("--out", help="write the JSON result here too")
    args = p.parse_args(argv)
    devices: List[Optional[str]] = args.devices.split(",") if args.devices else [None]
    n = len(devices) if args.devices else args.workers
    with tempfile.TemporaryDirectory(prefix="dflash-scaleout-") as tmp:
        root = Path(tmp)
        model = {"target": args.target, "draft": args.draft} if args.target else tiny_pair(root / "models")
        write_prompts(root / "prompts.jsonl", args.rows)
        runs = [one_run(root, 1, devices[:1], model, args), one_run(root, n, devices, model, args)]
    result = {
        "machine": platform.platform(),
        "model": args.target or "tiny seeded pair (CPU smoke size)",
        "rows": args.rows, "chunk_size": args.chunk_size, "max_tokens": args.max_tokens,
        "runs": runs,
        "speedup": round(runs[1]["rows_per_s"] / runs[0]["rows_per_s"], 3),
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(r["every_id_exactly_once"] and r["state"] == "completed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
