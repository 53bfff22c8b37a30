"""Several workers on one job, and the faults around them: real ``dflash-batch worker`` processes,
a real SQLite queue or ``redis-server`` (skipped where none is installed), the fake engine
(tests/fake_engine.py) so each item takes a known time. Every test ends with every id written
exactly once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import dflash_batch
from dflash_batch import api
from dflash_batch.runner.store import ResultStore
from tests.runner_fixtures import REPO, cli, fake_models, home, wait_for, workers, write_jsonl  # noqa: F401

pytestmark = pytest.mark.slow
LEASE_S = 3  # short leases, so a dead or hung holder's chunk comes back within seconds


@pytest.fixture
def fast(fake_models, monkeypatch):
    """Fake engine, one item per batch, ``delay`` s per item; leases of LEASE_S seconds."""
    monkeypatch.setenv("DFLASH_BATCH_LEASE_S", str(LEASE_S))
    monkeypatch.setenv("FAKE_ENGINE_BATCH", "1")
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.05")
    return fake_models


def prompts(n):
    return [{"id": f"item-{i:03d}", "prompt": f"Item {i}: tell me more"} for i in range(n)]


def submit(tmp_path, fast, n, **kw):
    return dflash_batch.submit(write_jsonl(tmp_path / "in.jsonl", prompts(n)), target=fast["target"], draft="none",
                               max_tokens=4, **kw)  # fmt: skip


def exactly_once(job, n):
    df = pd.read_parquet(job.output_dir)
    assert (
        len(df) == n and df["id"].is_unique and set(df["id"]) == {f"item-{i:03d}" for i in range(n)}
    )
    return df


def chunks_run_by(worker) -> int:
    """Chunks a worker generated: each run's log line names the chunks it closed ("with chunks [..]")."""
    return sum(
        len(m.split(","))
        for m in re.findall(r"\(with chunks \[([0-9, ]+)\]\): \d+ generated \(", worker.log())
    )


def test_two_workers_run_chunks_of_one_job_at_once(tmp_path, home, fast, workers, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.2")
    hold = tmp_path / "hold"
    monkeypatch.setenv("FAKE_ENGINE_HOLD", str(hold))
    a, b = workers(), workers()
    # both consume before the job exists: a worker that started late would find nothing left
    wait_for(
        lambda: all("worker started" in w.log() for w in (a, b)),
        timeout=120,
        what="both workers started",
    )
    hold.touch()
    job = submit(tmp_path, fast, 40, chunk_size=4)
    # In lockstep until each worker has held two chunks: every round holds both at their next
    # item and then lets both go, so on a busy machine neither can run the job alone.
    held_files = [tmp_path / f"hold.{w.proc.pid}" for w in (a, b)]
    chunks = {}
    while len(chunks) < 2 or any(len(c) < 2 for c in chunks.values()):
        wait_for(
            lambda: all(f.exists() for f in held_files),
            timeout=120,
            interval=0.02,
            what="both workers held mid-chunk",
        )
        for lease in api.activity(home)["leases"]:
            chunks.setdefault(lease["worker"], set()).add(lease["chunk"])
        hold.unlink()
        wait_for(
            lambda: not any(f.exists() for f in held_files),
            timeout=120,
            interval=0.02,
            what="both workers going again",
        )
        hold.touch()
    hold.unlink()
    assert job.wait(timeout=240)["state"] == "completed"
    exactly_once(job, 40)
    # a worker logs the chunks of a run when the run ends, which can trail the job's completion
    wait_for(lambda: chunks_run_by(a) + chunks_run_by(b) == 10, timeout=120, what="both run logs")
    assert chunks_run_by(a) >= 2 and chunks_run_by(b) >= 2, (a.log(), b.log())  # both did real work
    assert chunks_run_by(a) + chunks_run_by(b) == 10
    assert "waits:" not in a.log() + b.log()  # nobody idles on a busy output dir
    assert a.stop() == 0 and b.stop() == 0


def test_status_shows_who_holds_which_chunk_and_each_workers_rate(
    tmp_path, home, fast, workers, monkeypatch
):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.3")
    hold = tmp_path / "hold"
    monkeypatch.setenv("FAKE_ENGINE_HOLD", str(hold))
    job = submit(tmp_path, fast, 24, chunk_size=6)
    a, b = workers("--device", "0"), workers("--device", "1")
    # both workers hold chunks at once (a worker may stream several chunks of the job)
    wait_for(
        lambda: len({r["worker"] for r in api.activity(home)["leases"]}) == 2,
        timeout=120,
        interval=0.1,
        what="chunks held by both workers",
    )
    wait_for(
        lambda: (
            all(w["rows"] > 0 for w in api.activity(home)["workers"])
            and len(api.activity(home)["workers"]) == 2
        ),
        timeout=120,
        interval=0.2,
        what="both workers' rates",
    )
    # held mid-chunk while status runs (heartbeats go on): on a busy machine the job could
    # otherwise end before status looks
    hold.touch()
    wait_for(lambda: list(tmp_path.glob("hold.*")), timeout=60, interval=0.05, what="a worker held")
    try:
        text = cli("status", job.id, home=home, check=True).stdout
        as_json = cli("status", job.id, "--json", home=home, check=True).stdout
    finally:
        hold.unlink()
    data = __import__("json").loads(as_json)
    assert (
        text.count(" held by ") >= 1
        and "rows/s" in text
        and "device 0" in text
        and "device 1" in text
    ), text
    assert {w["device"] for w in data["workers"]} == {"0", "1"} and all(
        w["rows_per_s"] > 0 for w in data["workers"]
    )
    assert all(h["worker"] in {w["id"] for w in data["workers"]} for h in data["holders"])
    assert job.wait(timeout=240)["state"] == "completed"
    exactly_once(job, 24)
    assert a.stop() == 0 and b.stop() == 0


def test_a_hung_worker_loses_its_chunk_after_its_lease_and_writes_nothing_more(
    tmp_path, home, fast, workers, monkeypatch
):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.2")
    n = 20
    job = submit(tmp_path, fast, n, chunk_size=20)  # one chunk: the hung worker holds all of it
    store = ResultStore(job.output_dir)
    a = workers()
    wait_for(
        lambda: len(store.journal_rows()) >= 3,
        timeout=120,
        interval=0.05,
        what="rows in a's journal",
    )
    a.proc.send_signal(signal.SIGSTOP)
    try:
        stopped_at = time.time()
        b = workers()
        assert job.wait(timeout=240)["state"] == "completed"
        assert time.time() - stopped_at >= LEASE_S  # b waited for the lease to expire
        wait_for(lambda: "chunk 0 of" in b.log(), timeout=30, what="b's log of the chunk")
        assert "requeued 1 unfinished chunk(s)" in b.log()  # at its start, or by its heartbeat
    finally:
        a.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: "lost" in a.log(), timeout=60, what="a to notice its lease is gone")
    time.sleep(1)
    exactly_once(job, n)
    assert not store.journals()  # a left nothing behind
    assert a.stop() == 0 and b.stop() == 0


def test_two_submits_of_one_job_at_once(tmp_path, home, fast, workers):
    write_jsonl(tmp_path / "in.jsonl", prompts(30))
    args = [
        "submit",
        tmp_path / "in.jsonl",
        "--target",
        fast["target"],
        "--no-draft",
        "--max-tokens",
        "4",
        "--chunk-size",
        "30",
        "--json",
    ]  # fmt: skip  (one chunk each: the two workers take one each, at once)
    env = dict(os.environ, DFLASH_BATCH_HOME=str(home))
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_batch.cli", *map(str, args)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    jobs = api.jobs(home)
    assert len(jobs) == 2 and jobs[0].output_dir == jobs[1].output_dir
    a, b = workers(), workers()
    for job in jobs:
        assert job.wait(timeout=240)["state"] == "completed"
    exactly_once(jobs[0], 30)
    assert a.stop() == 0 and b.stop() == 0


def test_a_job_with_another_chunk_size_on_a_busy_output_dir_is_refused(tmp_path, home, fast):
    job = submit(tmp_path, fast, 10, chunk_size=5)
    refused = cli("submit", tmp_path / "in.jsonl", "--target", fast["target"], "--no-draft", "--max-tokens", "4",
                  "--chunk-size", "4", home=home)  # fmt: skip
    assert refused.returncode == 2 and "chunk_size" in refused.stderr and job.id in refused.stderr
    assert len(api.jobs(home)) == 1


# -- full disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full-disk test needs root to mount a small tmpfs")
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path, spare: int = 0) -> None:
    """Write zeros until the file system is full, then give back ``spare`` bytes."""
    with open(path, "wb", buffering=0) as f:
        for size in (65536, 4096, 64, 1):  # down to the last byte
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass
    os.truncate(path, max(path.stat().st_size - spare, 0))


def test_a_full_disk_leaves_nothing_half_written_and_the_job_resumes(
    tmp_path, home, fast, workers, small_disk
):
    n = 24
    job = submit(tmp_path, fast, n, chunk_size=4, output_dir=str(small_disk / "out"))
    store = ResultStore(job.output_dir)
    filler = small_disk / "filler"
    fill(filler, spare=8192)  # room for journal lines, not for a part: a part write fails half-way
    w = workers()
    wait_for(
        lambda: "No space left on device" in w.log(),
        timeout=120,
        what="the worker to hit the full disk",
    )
    time.sleep(1)
    visible = [p for p in Path(job.output_dir).iterdir() if not p.name.startswith((".", "_"))]
    for part in visible:  # whatever a reader sees is a complete part
        pd.read_parquet(part)
    assert not list(Path(job.output_dir).glob(".*.tmp"))  # no half-written part stays behind
    assert job.status()["state"] != "completed"
    filler.unlink()  # space returns
    assert job.wait(timeout=240)["state"] == "completed"
    exactly_once(job, n)
    assert not store.journals()
    assert w.stop() == 0


# -- Redis ----------------------------------------------------------------------------------------


class RedisServer:
    """A redis-server on a free port, its append-only file (fsync always) in ``folder`` when
    ``persistent``, else with no persistence at all."""

    def __init__(self, folder: Path, persistent: bool = True):
        self.persistent = persistent
        self.binary = shutil.which("redis-server")
        self.folder = folder
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                                      "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always",
                                      "--save", ""],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        client = redis.Redis.from_url(self.url)

        def up():
            try:
                return client.ping()
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                return False

        wait_for(up, timeout=30, interval=0.05, what="redis-server")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def redis_server(tmp_path, monkeypatch, request):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    pytest.importorskip("redis")
    server = RedisServer(tmp_path, persistent=getattr(request, "param", True))
    monkeypatch.setenv("DFLASH_BATCH_REDIS_URL", server.url)
    try:
        yield server
    finally:
        server.stop()


def test_worker_killed_9_mid_chunk_on_redis(
    tmp_path, home, fast, workers, redis_server, monkeypatch
):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.2")
    n = 24
    job = submit(tmp_path, fast, n, chunk_size=12)
    store = ResultStore(job.output_dir)
    a = workers()
    wait_for(
        lambda: len(store.journal_rows()) >= 3,
        timeout=120,
        interval=0.05,
        what="rows in a's journal",
    )
    a.kill9()
    before = {r["id"]: r["started_at"] for r in store.journal_rows()}
    b = workers()
    assert job.wait(timeout=240)["state"] == "completed"
    df = exactly_once(job, n)
    after = dict(zip(df["id"], (t.timestamp() for t in df["started_at"])))
    assert all(
        after[i] == pytest.approx(t, abs=1e-5) for i, t in before.items()
    )  # a's rows were kept, not redone
    assert b.stop() == 0


@pytest.mark.parametrize(
    "redis_server", [True, False], ids=["append-only", "no-persistence"], indirect=True
)
def test_redis_restarted_mid_job_loses_no_item(
    tmp_path, home, fast, workers, redis_server, monkeypatch
):
    """With its append-only file, Redis keeps the queued tasks and leases; without persistence
    everything queued is gone, and the workers' reaper requeues it from the job records."""
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.1")
    n = 40
    # batch 1: a worker's stream takes at most 2 chunks (worker.STREAM_BATCHES rows), so chunks are
    # still waiting in the queue at the outage (with the default batch the two workers could take
    # all 10 at once, and then nothing was lost and nothing needed requeueing)
    job = submit(tmp_path, fast, n, chunk_size=4, batch_size=1)
    a, b = workers(), workers()
    wait_for(lambda: job.status()["done"] >= 6, timeout=120, interval=0.05, what="first items")
    assert len(job.record.pending_chunks()) > 4  # more than the two workers' streams hold
    redis_server.kill()  # kill -9: only what the append-only file holds survives
    time.sleep(1.5)
    redis_server.start()
    assert job.wait(timeout=240)["state"] == "completed"
    exactly_once(job, n)
    logs = a.log() + b.log()
    assert "Connection refused" in logs  # the outage was seen
    if not redis_server.persistent:  # the lost queue came back from the job records
        assert "unfinished chunk(s)" in logs
    assert a.stop() == 0 and b.stop() == 0


def test_a_second_home_on_one_redis_is_refused(tmp_path, home, fast, redis_server):
    submit(tmp_path, fast, 2)
    other = tmp_path / "other-home"
    refused = cli("submit", tmp_path / "in.jsonl", "--target", fast["target"], home=other)
    assert refused.returncode == 2 and "mount that shared folder" in refused.stderr
    worker = cli("worker", home=other, timeout=60)
    assert worker.returncode == 2 and "shared-home" in worker.stderr


def test_a_process_that_finds_the_queue_bound_waits_for_the_binders_manifest(tmp_path):
    """The first process on a Redis db binds the queue, then writes the home's manifest; a second
    process of the same home that looks in between (a worker started a moment before a submit)
    waits for the manifest instead of refusing the home as unmounted; with no manifest coming, it
    refuses."""
    import threading

    import orjson
    from huey.constants import EmptyData

    from dflash_batch.errors import SetupError
    from dflash_batch.runner import scaleout

    class Storage:
        def __init__(self):
            self.data = {}

        def peek_data(self, key):
            return self.data.get(key, EmptyData)

        def put_if_empty(self, key, value):
            return self.data.setdefault(key, value) is value

    storage, home = Storage(), tmp_path / "home"
    home.mkdir()
    record = {"id": "abc", "path": str(home), "host": "vm", "at": 0}
    storage.data[scaleout.HOME_KEY] = orjson.dumps(record)  # bound; its manifest not written yet

    def write_manifest():  # as the binder does: whole or not at all (a rename)
        part = home / "manifest.part"
        part.write_bytes(orjson.dumps(record))
        part.replace(home / scaleout.HOME_MANIFEST)

    late = threading.Timer(0.3, write_manifest)
    late.start()
    assert scaleout.claim_home(storage, home) == "abc"
    late.join()
    (home / scaleout.HOME_MANIFEST).unlink()
    with pytest.raises(SetupError, match="does not exist"):
        scaleout.claim_home(storage, home)
