"""The server's overhead on whole-job time: one N-line OpenAI batch file (default 1,000 short
chat requests) through ``dflash-batch serve --worker`` and the same file through
``dflash-batch run``, on the default pair, each arm a fresh home and fresh processes, the arms
alternating, median of ``--runs`` runs per arm.

    .venv/bin/python -m benchmarks.serve_overhead --lines 1000 --max-tokens 8 --runs 2

    run     ``dflash-batch run FILE -q``: process start to exit
    serve   ``dflash-batch serve --worker`` started, then OpenAI's client uploads the file,
            creates the batch, polls it every ``--poll`` s until completed and downloads the
            output file: serve's process start to the output in hand
    worker  (with ``--arms``) the queue without the server: ``dflash-batch submit FILE``, then
            ``dflash-batch worker`` until the job completes (polled every ``--poll`` s)

``overhead`` = median serve / median run - 1, ``worker_overhead`` = serve / worker - 1 (the
queue's pick-up delay, the HTTP calls, the output and error files, and the polling interval all
count). Every arm must give the same greedy outputs (checked). The machine's load average is
recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("run", "serve", "worker")


def write_batch(path: Path, lines: int, max_tokens: int) -> Path:
    with open(path, "w") as f:
        for i in range(lines):
            body = {
                "model": "default",
                "max_tokens": max_tokens,
                "messages": [
                    {"role": "user", "content": f"Give one word that rhymes with number {i}."}
                ],
            }
            f.write(
                json.dumps(
                    {
                        "custom_id": f"q-{i:05d}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                )
                + "\n"
            )
    return path


def cli(*args: str) -> list:
    return [sys.executable, "-m", "dflash_batch.cli", *args]


def run_arm(source: Path, home: Path) -> dict:
    started = time.perf_counter()
    done = subprocess.run(cli("run", str(source), "-q", "--home", str(home)), cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    whole = time.perf_counter() - started
    if done.returncode not in (0, 5):
        raise RuntimeError(f"run exited {done.returncode}: {done.stderr[-2000:]}")
    from dflash_batch import api

    [job] = api.jobs(home)
    rows = job.to_arrow().select(["id", "output"]).to_pylist()
    return {"arm": "run", "whole": whole, "outputs": {r["id"]: r["output"] for r in rows}}


def worker_arm(source: Path, home: Path, poll: float) -> dict:
    from dflash_batch import api

    started = time.perf_counter()
    submitted = subprocess.run(cli("submit", str(source), "--home", str(home)), cwd=ROOT,
                               capture_output=True, text=True, check=True)  # fmt: skip
    job = api.Job(submitted.stdout.split()[0], home)
    worker = subprocess.Popen(
        cli("worker", "--home", str(home)),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while job.status()["state"] not in ("completed", "failed", "cancelled"):
            time.sleep(poll)
        whole = time.perf_counter() - started
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    rows = job.to_arrow().select(["id", "output"]).to_pylist()
    return {"arm": "worker", "whole": whole, "outputs": {r["id"]: r["output"] for r in rows}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_arm(source: Path, home: Path, poll: float) -> dict:
    import openai

    port = free_port()
    started = time.perf_counter()
    server = subprocess.Popen(
        cli("serve", "--worker", "--port", str(port), "--home", str(home)),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0)  # fmt: skip
        _wait_up(client, server)
        with open(source, "rb") as f:
            upload = client.files.create(file=f, purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(poll)
            batch = client.batches.retrieve(batch.id)
        if batch.status != "completed" or batch.output_file_id is None:
            raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
        text = client.files.content(batch.output_file_id).text
        whole = time.perf_counter() - started
    finally:
        server.terminate()
        server.wait(timeout=120)
    lines = [json.loads(ln) for ln in text.splitlines()]
    outputs = {ln["custom_id"]: ln["response"]["body"]["choices"][0]["message"]["content"]
               for ln in lines}  # fmt: skip
    return {"arm": "serve", "whole": whole, "outputs": outputs}


def _wait_up(client, server) -> None:
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"serve exited {server.returncode}")
        try:
            client.models.list()
            return
        except Exception:  # not listening yet
            time.sleep(0.05)


def summary(runs: list) -> dict:
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    medians = {a: statistics.median(r["whole"] for r in runs if r["arm"] == a) for a in arms}
    outputs = {json.dumps(r["outputs"], sort_keys=True) for r in runs}
    out = {f"{a}_whole_s": round(medians[a], 3) for a in arms}
    for base, key in (("run", "overhead"), ("worker", "worker_overhead")):
        if base in medians and "serve" in medians:
            out[key] = round(medians["serve"] / medians[base] - 1, 4)
    out["runs"] = {a: [round(r["whole"], 3) for r in runs if r["arm"] == a] for a in arms}
    out["same_outputs"] = len(outputs) == 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lines", type=int, default=1000, help="requests in the batch (default 1000)")
    ap.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request")
    ap.add_argument("--runs", type=int, default=2, help="runs per arm (median)")
    ap.add_argument("--poll", type=float, default=0.5, help="the client's polling interval, s")
    ap.add_argument(
        "--arms",
        default="run,serve",
        help="comma-separated, of run, serve, worker (default run,serve)",
    )
    ap.add_argument("--out", help="also write the result here (JSON)")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: choose among {', '.join(ARMS)}")
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
        source = write_batch(Path(tmp) / "batch.jsonl", args.lines, args.max_tokens)
        for n in range(args.runs):
            for arm in arms if n % 2 == 0 else reversed(arms):
                home = Path(tmp) / f"home-{arm}-{n}"
                if arm == "run":
                    one = run_arm(source, home)
                elif arm == "serve":
                    one = serve_arm(source, home, args.poll)
                else:
                    one = worker_arm(source, home, args.poll)
                print(f"{arm}: {one['whole']:.2f} s", file=sys.stderr)
                runs.append(one)
    result = dict(
        summary(runs),
        lines=args.lines,
        max_tokens=args.max_tokens,
        poll_s=args.poll,
        load_before=[round(x, 2) for x in load_before],
        load_after=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(),
        command="python -m benchmarks.serve_overhead " + " ".join(argv or sys.argv[1:]),
    )
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["same_outputs"] else 1


if __name__ == "__main__":
    sys.exit(main())
