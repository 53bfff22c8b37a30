"""Shared fixtures of the serve tests: a live ``dflash-batch serve`` on loopback, batch input
lines, and a poll for a batch's end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runner_fixtures import REPO, wait_for

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_line(
    custom_id: str, content: str = "say something", max_tokens: int = 4, url: str = CHAT
) -> dict:
    body = {"model": "any", "max_tokens": max_tokens}
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = content
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines) -> bytes:
    text = [ln if isinstance(ln, str) else json.dumps(ln) for ln in lines]
    return b"".join(ln.encode() + b"\n" for ln in text)


class Server:
    """A ``dflash-batch serve`` process on a free loopback port, its log in a file."""

    def __init__(self, home: Path, log: Path, *extra, api_key: str = "unused"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")
        env = dict(os.environ, DFLASH_BATCH_HOME=str(home), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_batch.cli", "serve", "--port", str(self.port),
             *map(str, extra)],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)
        wait_for(self._up, timeout=60, what=f"serve on port {self.port}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.log()}")
        try:
            httpx.get(f"{self.url}/v1/models", timeout=2)
            return True
        except httpx.HTTPError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


@pytest.fixture
def servers(home, fake_models, tmp_path):
    """Start servers with ``servers(*extra_args)`` (the fake engine for any worker); all are
    stopped at teardown."""
    started = []

    def start(*extra, **kw):
        s = Server(home, tmp_path / f"serve-{len(started)}.log", *extra, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def wait_batch(
    client,
    batch_id: str,
    states=("completed", "failed", "cancelled", "expired"),
    timeout: float = 180,
):
    seen = []

    def ended():
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        return batch if batch.status in states else None

    batch = wait_for(ended, timeout=timeout, interval=0.3, what=f"batch {batch_id} in {states}")
    return batch, seen


def lines_of(client, file_id) -> list:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def stored_files(home: Path) -> list:
    """What the server keeps under the home (file and batch folders, staging leftovers)."""
    root = home / "serve"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def job_records(home: Path) -> list:
    jobs = home / "jobs"
    return sorted(p.name for p in jobs.iterdir()) if jobs.is_dir() else []
