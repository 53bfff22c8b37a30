"""Shared fixtures of the runner tests: a tiny seeded model pair, homes, worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fake_engine import FakeEngine
from tests.helpers import REPO


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"target", "draft", "agreeing_target"}: seeded random models saved in real formats.

    ``agreeing_target`` has a zeroed output head (every logit equal, greedy choice always id 0),
    so the drafter, which reuses the target's head, agrees with it: acceptance is 1.
    """
    from tests import synthetic

    root = tmp_path_factory.mktemp("runner-models")
    cfg = synthetic.tiny_qwen3_config()
    synthetic.save_target(root / "target", cfg, seed=0)
    synthetic.save_target(root / "agreeing_target", cfg, seed=0, zero_head=True)
    synthetic.save_drafter(root / "draft", synthetic.drafter_config(cfg, block_size=8), seed=1)
    return {k: str(root / k) for k in ("target", "draft", "agreeing_target")}


@pytest.fixture(scope="session")
def real_engine(tiny_models):
    """The real MLX engine on the tiny pair: for the end-to-end tests of each entry point."""
    from dflash_batch.engine import load_engine

    return load_engine(tiny_models["target"], tiny_models["draft"])


@pytest.fixture
def engine():
    """The fake engine (tests/fake_engine.py): the runner's own tests need no model and no MLX."""
    return FakeEngine()


FAKE_FACTORY = "tests.fake_engine:from_env"


@pytest.fixture
def fake_models(tmp_path, monkeypatch):
    """Like ``tiny_models`` (folders to name as target and draft), with every engine this test
    loads, in this process, in ``dflash-batch`` subprocesses and in workers, the fake one
    (``$DFLASH_BATCH_ENGINE``); ``FAKE_ENGINE_DELAY`` and friends tune it."""
    monkeypatch.setenv("DFLASH_BATCH_ENGINE", FAKE_FACTORY)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    )
    out = {}
    for name in ("target", "draft", "agreeing_target"):
        (tmp_path / "fake-models" / name).mkdir(parents=True, exist_ok=True)
        out[name] = str(tmp_path / "fake-models" / name)
    return out


class CountingEngine:
    """Wraps a real engine and records each prompt it is asked to generate; a prompt in
    ``fail_ids`` fails alone (a RuntimeError outcome), as one request of a batch can."""

    def __init__(self, engine, fail_ids=()):
        self.engine = engine
        self.calls = []
        self.fail_prompts = set(fail_ids)

    def seen(self, request) -> None:
        self.calls.append(request.prompt)

    def generate_requests(self, requests, batch_size=None):
        failed = []

        def feed():
            for request in requests:
                self.seen(request)
                if isinstance(request.prompt, str) and request.prompt in self.fail_prompts:
                    failed.append(request)
                    continue
                yield request

        for out in self.engine.generate_requests(feed(), batch_size):
            while failed:
                yield failed.pop(), RuntimeError("simulated failure")
            yield out
        while failed:
            yield failed.pop(), RuntimeError("simulated failure")


@pytest.fixture
def home(tmp_path, monkeypatch):
    path = tmp_path / "home"
    monkeypatch.setenv("DFLASH_BATCH_HOME", str(path))
    return path


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def cli(
    *args, home: Path, timeout: float = 300, check: bool = False
) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_BATCH_HOME=str(home))
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_batch.cli", *map(str, args)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(
            f"dflash-batch {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


class Worker:
    """A real ``dflash-batch worker`` process with its log in a file."""

    def __init__(self, home: Path, log: Path, *extra):
        self.log_path = log
        self._log = open(log, "wb")
        env = dict(os.environ, DFLASH_BATCH_HOME=str(home), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_batch.cli", "worker", "--shutdown-timeout", "60", *map(str, extra)],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def pause(self) -> None:
        """SIGSTOP, returning once every thread has stopped (where /proc tells): what the test
        then reads of the worker's files stays true until it resumes or is killed."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while tasks.exists() and not all(_stopped(t) for t in tasks.iterdir()):
            time.sleep(0.005)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()


def _stopped(task: Path) -> bool:
    """Whether a thread (/proc/PID/task/TID) is stopped, or gone."""
    try:
        return (task / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return True


@pytest.fixture
def workers(home, tmp_path):
    """Start workers with ``workers(*extra_args)``; all are killed at teardown."""
    started = []

    def start(*extra):
        w = Worker(home, tmp_path / f"worker-{len(started)}.log", *extra)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def wait_for(predicate, timeout: float = 240, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
