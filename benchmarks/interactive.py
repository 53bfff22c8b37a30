"""Latency of interactive requests: time to first token and per-token latency of streamed chat
requests at several concurrencies, through ``dflash-batch serve`` (with its drafter, and with
``--draft none``) and through ``mlx_lm.server`` on the same target folder and prompts; for
``dflash-batch serve --worker``, also while a batch job runs, with the job's throughput cost.

    .venv/bin/python -m benchmarks.interactive --clients 1 4 16 --requests 2 --max-tokens 64 \\
        --out docs/results/interactive-cpu.json

    arms    dflash       dflash-batch serve, the target's drafter (default: the embedded pair)
            plain        dflash-batch serve --draft none
            mlx_lm       python -m mlx_lm.server --model TARGET (continuous batching, no drafter)
            dflash+job   dflash-batch serve --worker, a batch job of --job-lines requests
                         submitted first: interactive requests join its running batch

Each client sends ``--requests`` streamed requests one after another (``max_tokens``,
temperature 0, prompts from ``benchmarks/data/chat_prompts.json`` or built in); a request's
time to first token is from sending to the first chunk with text, its per-token latency
(last chunk - first chunk) / (tokens - 1), the tokens from the usage chunk (or one a chunk
where a server sends none). One warm-up request per server is not counted. Medians and p90 per
arm and concurrency; for ``dflash+job`` the job's whole time alone (``--job-alone``) and with
the clients. Servers run one at a time, each in its own process, on a fresh home.
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
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Give me a fun fact about octopuses.",
    "Write a short polite email declining a meeting.",
    "How do I reverse a list in Python?",
]
ARMS = ("dflash", "plain", "mlx_lm", "dflash+job")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    arm: str,
    target: Optional[str],
    draft: Optional[str],
    home: Path,
    port: int,
    slots: int,
    log: Path,
) -> subprocess.Popen:
    env = dict(os.environ, DFLASH_BATCH_HOME=str(home), PYTHONUNBUFFERED="1")
    if arm == "mlx_lm":
        command = [sys.executable, "-m", "mlx_lm.server", "--model", target, "--port", str(port)]
    else:
        command = [sys.executable, "-m", "dflash_batch.cli", "serve", "--port", str(port),
                   "--interactive-slots", str(slots)]  # fmt: skip
        if target:
            command += ["--target", target]
        if arm == "plain":
            command += ["--draft", "none"]
        elif draft:
            command += ["--draft", draft]
        if arm == "dflash+job":
            command += ["--worker"]
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT
    )


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            httpx.get(f"{url}/v1/models", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(url)


def one_request(url: str, prompt: str, max_tokens: int, model: str) -> Dict[str, float]:
    """A streamed chat request: {ttft, per_token, tokens, total} in seconds."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last, chunks = now, chunks + 1
    tokens = usage["completion_tokens"] if usage else chunks
    first = first if first is not None else time.perf_counter()
    last = last if last is not None else first
    return {"ttft": first - sent, "per_token": (last - first) / max(tokens - 1, 1), "tokens": tokens,
            "total": last - sent}  # fmt: skip


def clients(
    url: str, count: int, requests: int, max_tokens: int, model: str
) -> List[Dict[str, float]]:
    out: List[Dict[str, float]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            got = one_request(url, PROMPTS[(c * requests + r) % len(PROMPTS)], max_tokens, model)
            with lock:
                out.append(got)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def submit_job(url: str, lines: int, max_tokens: int) -> str:
    import httpx

    text = "".join(json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "max_tokens": max_tokens, "messages": [
                                   {"role": "user", "content": f"Write a sentence about the number {i}."}]}})
                   + "\n" for i in range(lines))  # fmt: skip
    upload = httpx.post(f"{url}/v1/files", files={"file": ("job.jsonl", text.encode())},
                        data={"purpose": "batch"}, timeout=60).json()  # fmt: skip
    batch = httpx.post(f"{url}/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                  "endpoint": "/v1/chat/completions"}, timeout=60).json()  # fmt: skip
    return batch["id"]


def wait_batch(url: str, batch_id: str) -> float:
    import httpx

    while True:
        batch = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=60).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            if batch["status"] != "completed":
                raise RuntimeError(f"batch {batch['status']}")
            return batch["completed_at"] - batch["in_progress_at"]
        time.sleep(0.2)


def summarise(results: List[Dict[str, float]]) -> Dict[str, float]:
    def q(values, p):
        values = sorted(values)
        return values[min(len(values) - 1, int(p * len(values)))]

    ttft = [r["ttft"] for r in results]
    per = [r["per_token"] for r in results]
    return {"requests": len(results), "ttft_median_s": round(statistics.median(ttft), 4),
            "ttft_p90_s": round(q(ttft, 0.9), 4), "per_token_median_ms": round(1000 * statistics.median(per), 2),
            "per_token_p90_ms": round(1000 * q(per, 0.9), 2),
            "tokens": sum(r["tokens"] for r in results)}  # fmt: skip


def run_arm(arm: str, args, work: Path) -> Dict[str, object]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    home = work / f"home-{arm.replace('+', '-')}"
    slots = max(args.clients)
    proc = start_server(arm, args.target, args.draft, home, port, slots, work / f"{arm}.log")
    out: Dict[str, object] = {"arm": arm, "by_clients": {}}
    try:
        wait_up(url, proc)
        model = "default_model"  # mlx_lm.server's name for its --model; dflash-batch takes any
        one_request(url, PROMPTS[0], args.max_tokens, model)  # warm-up: model load, first shapes
        if arm == "dflash+job":
            if args.job_alone:
                out["job_alone_s"] = wait_batch(
                    url, submit_job(url, args.job_lines, args.job_max_tokens)
                )
            batch = submit_job(url, args.job_lines, args.job_max_tokens)
            time.sleep(args.job_head_start)
        for count in args.clients:
            out["by_clients"][count] = summarise(
                clients(url, count, args.requests, args.max_tokens, model)
            )
        if arm == "dflash+job":
            out["job_with_clients_s"] = wait_batch(url, batch)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def default_pair():
    """mlx_lm.server needs a model folder: the embedded default pair's converted folders."""
    import dflash_batch.engine  # noqa: F401  (a fast BLAS before mlx)
    from dflash_batch.engine.models import registry

    return registry.default_pair()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target folder (default: the embedded pair's target)")
    p.add_argument("--draft", help="drafter (default: the target's registered one)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--job-lines", type=int, default=64)
    p.add_argument("--job-max-tokens", type=int, default=64)
    p.add_argument(
        "--job-head-start", type=float, default=2.0, help="seconds between the job and the clients"
    )
    p.add_argument("--job-alone", action="store_true", help="also time the job without clients")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.target is None:
        args.target, args.draft = default_pair()  # every arm on the same folders
    results = {"command": " ".join([sys.executable, "-m", "benchmarks.interactive", *(argv or sys.argv[1:])]),
               "load_before": os.getloadavg(), "arms": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for arm in args.arms:
            got = run_arm(arm, args, Path(tmp))
            results["arms"].append(got)
            print(json.dumps(got), flush=True)
    results["load_after"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
