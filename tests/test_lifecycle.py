"""A job's life around the queue: a foreground run stays foreground (a worker never takes it, its
rerun resumes it), records that do not pile up (refusals, no-op resubmits, rm and prune),
ambiguous ids, and a waiting job that says no worker serves it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

import dflash_batch
from dflash_batch import api
from dflash_batch import cli as cli_module
from dflash_batch.errors import JobActive, Locked, SetupError
from dflash_batch.runner.lease import Leases
from dflash_batch.runner.lock import DirLock
from dflash_batch.runner.queue import Queue
from dflash_batch.runner.worker import Worker
from tests.fake_engine import FakeEngine
from tests.runner_fixtures import REPO, CountingEngine, cli, fake_models, home, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt number {i}: tell me more."} for i in range(7)]
STALL_ENV = "LIFECYCLE_STALL_AFTER"


def stalling(**model):
    """An engine factory for `dflash-batch run` subprocesses: the fake engine, which with
    $LIFECYCLE_STALL_AFTER=n hangs after n rows until the process is stopped."""
    return Stalling(FakeEngine(batch=1), int(os.environ.get(STALL_ENV, "-1")))


class Stalling:
    def __init__(self, engine, after: int):
        self.engine, self.after = engine, after

    def generate_requests(self, requests, batch_size=None):
        for n, out in enumerate(self.engine.generate_requests(requests, 1)):
            if n == self.after:
                print("stalled", flush=True)
                time.sleep(3600)  # until SIGINT or SIGKILL
            yield out


def run_args(src, out):
    return ["run", src, "--target", "fake-target", "--max-tokens", 4, "--chunk-size", 2, "-o", out,
            "--no-progress"]  # fmt: skip


def start_run(src, out, home, stall_after):
    env = dict(os.environ, DFLASH_BATCH_HOME=str(home), **{STALL_ENV: str(stall_after)},
               DFLASH_BATCH_ENGINE="tests.test_lifecycle:stalling")  # fmt: skip
    command = [sys.executable, "-m", "dflash_batch.cli", *map(str, run_args(src, out))]
    pipe = subprocess.PIPE
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=pipe, stderr=pipe, text=True)


def a_worker(home, loaded):
    """An in-process queue worker (not started): its reaper and chunk runner, called directly."""
    return Worker(Queue(home), lambda **model: loaded.append(model) or FakeEngine())


# -- item 3: a foreground run stays foreground ------------------------------------------------
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_stopped_foreground_run_is_left_to_its_rerun(tmp_path, home, fake_models, stop):
    src, out = write_jsonl(tmp_path / "in.jsonl", PROMPTS), tmp_path / "out"
    proc = start_run(src, out, home, stall_after=3)
    assert proc.stdout.readline().strip() == "stalled"  # 3 rows finished, the 4th hangs
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=120)
    if stop == signal.SIGINT:
        assert proc.returncode == 130 and "rerun to resume" in err and "Traceback" not in err
    [job] = api.jobs(home)
    assert job.status()["state"] == "interrupted"
    # a worker on the same home neither requeues nor runs any of its chunks
    loaded = []
    worker = a_worker(home, loaded)
    assert worker.reap() == 0 and worker.queue.queued_task_ids() == set()
    worker.queue.enqueue_job(job.record)  # a stray task (from an older version, say)
    for chunk in job.record.pending_chunks():
        worker.run_chunk(job.id, chunk)
    assert loaded == [] and worker.queue.requeue_unfinished() == 0
    # the rerun is not refused: it resumes the same job, every id exactly once
    rerun = cli(*run_args(src, out), home=home)
    assert rerun.returncode == 0, rerun.stderr
    assert [j.id for j in api.jobs(home)] == [job.id] and job.status()["state"] == "completed"
    df = pd.read_parquet(out)
    assert sorted(df["id"]) == sorted(p["id"] for p in PROMPTS) and df["id"].is_unique


def test_rerun_after_ctrl_c_generates_only_the_rest(tmp_path, home):
    src, out = write_jsonl(tmp_path / "in.jsonl", PROMPTS), tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        api.run(src, engine=Interrupting(FakeEngine(batch=1), 3), chunk_size=2, output_dir=str(out))
    [job] = api.jobs(home)
    assert job.status()["done"] == 3 and job.record.foreground()
    again = CountingEngine(FakeEngine())
    rerun = api.run(src, engine=again, chunk_size=2, output_dir=str(out))
    assert rerun.status()["state"] == "completed" and len(again.calls) == 4
    assert rerun.id == job.id and len(api.jobs(home)) == 1  # the same job, resumed
    with pytest.raises(KeyboardInterrupt):  # a run with other settings is another job
        api.run(src, engine=Interrupting(FakeEngine(), 1), chunk_size=2, output_dir=f"{out}2")
    assert len(api.jobs(home)) == 2


class Interrupting:
    """Ctrl-C after ``after`` rows, as the terminal's SIGINT raises it in the main thread."""

    def __init__(self, engine, after: int):
        self.engine, self.after = engine, after

    def generate_requests(self, requests, batch_size=None):
        for n, out in enumerate(self.engine.generate_requests(requests, 1)):
            if n == self.after:
                raise KeyboardInterrupt
            yield out


def test_retry_hands_a_foreground_job_to_the_queue(tmp_path, home):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    job = api.run(src, engine=FakeEngine(fail={PROMPTS[0]["prompt"]}), max_tokens=4)
    assert job.record.foreground() and job.status()["failed"] == 1
    assert api.retry(job.id, failed_only=True)["chunks"] == 1
    assert not job.record.foreground()  # queued now: a worker runs it
    loaded = []
    a_worker(home, loaded).run_chunk(job.id, 0)
    assert loaded and job.status()["state"] == "completed" and job.status()["failed"] == 0


# -- item 10: records that do not pile up ----------------------------------------------------
def test_refused_run_and_submit_leave_no_record(tmp_path, home, fake_models, monkeypatch):
    src, out = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2]), tmp_path / "out"
    with DirLock(out):
        with pytest.raises(Locked):
            api.run(src, engine=FakeEngine(), output_dir=str(out))
        busy = cli(*run_args(src, out), home=home)
    assert busy.returncode == 3 and api.jobs(home) == []

    def unusable(home):
        raise SetupError("queue.db: on a network file system")

    monkeypatch.setattr("dflash_batch.runner.queue.check_sqlite_home", unusable)
    with pytest.raises(SetupError):
        api.submit(src, target=fake_models["target"])
    assert api.jobs(home) == []


def test_a_no_op_resubmit_or_rerun_adds_no_record(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:3])
    first = api.run(src, engine=FakeEngine(), max_tokens=4)
    again = api.submit(src, max_tokens=4)
    assert again.id == first.id and again.status()["state"] == "completed"
    assert api.run(src, engine=FakeEngine(), max_tokens=4).id == first.id
    out = cli("submit", src, "--max-tokens", 4, home=home, check=True)
    assert out.stdout.split() == [first.id] and "nothing queued" in out.stderr
    assert [j.id for j in api.jobs(home)] == [first.id]
    # other settings, or other rows, are another job
    assert api.run(src, engine=FakeEngine(), max_tokens=4, export_openai=True).id != first.id
    assert len(api.jobs(home)) == 2


def finished_job(tmp_path, home, name, rows=PROMPTS[:2], **kw):
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    return api.run(src, engine=FakeEngine(), name=name, max_tokens=4, **kw)


def queued_job(tmp_path, fake_models, rows=PROMPTS[:1]):
    src = write_jsonl(tmp_path / "q.jsonl", rows)
    return dflash_batch.submit(src, target=fake_models["target"])


def test_rm_removes_finished_jobs_and_their_files_only_on_request(tmp_path, home):
    kept = finished_job(tmp_path, home, "kept")
    gone = finished_job(tmp_path, home, "gone")
    kept_dir, gone_dir = kept.output_dir, gone.output_dir
    assert api.remove([kept.id]) == {kept.id: None}
    assert not kept.record.dir.exists() and len(list(kept_dir.glob("*.parquet"))) == 1  # files stay
    (gone_dir / "notes.txt").write_text("mine")  # not a result: never deleted
    [(job_id, why)] = api.remove([gone.id[:-2]], files=True).items()
    assert job_id == gone.id and "files of other kinds stay" in why
    assert sorted(p.name for p in gone_dir.iterdir()) == ["notes.txt"]
    clean = finished_job(tmp_path, home, "clean")
    out_dir = clean.output_dir
    out = cli("rm", clean.id, "--files", home=home, check=True)
    assert out.stdout.strip() == f"removed {clean.id}" and not out_dir.exists()


def test_rm_keeps_a_dir_another_job_writes_and_refuses_unfinished_ones(tmp_path, home, fake_models):
    shared = tmp_path / "shared"
    a = finished_job(tmp_path, home, "a", output_dir=str(shared))
    b = finished_job(tmp_path, home, "b", rows=PROMPTS[2:4], output_dir=str(shared))
    why = api.remove([a.id], files=True)[a.id]
    assert f"job(s) {b.id} write there too" in why
    assert len(list(shared.glob("*.parquet"))) == 2
    queued = queued_job(tmp_path, fake_models)
    refused = cli("rm", b.id, queued.id, "--files", home=home)
    assert refused.returncode == 2 and f"job {queued.id} is queued" in refused.stderr
    assert "cancel" in refused.stderr and "Traceback" not in refused.stderr
    assert {j.id for j in api.jobs(home)} == {b.id, queued.id} and shared.exists()  # nothing went
    with pytest.raises(JobActive):
        api.remove([queued.id])
    assert cli("rm", b.id, "no-such-job", home=home).returncode == 4 and b.record.dir.exists()
    queued.cancel()
    assert set(api.remove([b.id, queued.id], files=True)) == {b.id, queued.id}
    assert not shared.exists() and api.jobs(home) == []


def test_prune_removes_finished_jobs_older_than_an_age(tmp_path, home, fake_models):
    old = finished_job(tmp_path, home, "old")
    queued = queued_job(tmp_path, fake_models)
    created = old.record.data["created_at"]
    assert api.prune(3600, now=created + 60) == {}
    assert api.prune(3600, now=created + 7200) == {old.id: None}
    assert [j.id for j in api.jobs(home)] == [queued.id] and old.output_dir.exists()
    bad = cli("prune", "--older-than", "soon", home=home)
    assert bad.returncode == 2 and "--older-than" in bad.stderr and "Traceback" not in bad.stderr
    out = cli("prune", "--older-than", "0s", home=home, check=True)
    assert "nothing removed" in out.stdout and [j.id for j in api.jobs(home)] == [queued.id]


def test_an_ambiguous_id_prefix_lists_the_candidates(tmp_path, home):
    a = finished_job(tmp_path, home, "same", rows=PROMPTS[:1], output_dir=str(tmp_path / "o1"))
    b = finished_job(tmp_path, home, "same", rows=PROMPTS[:2], output_dir=str(tmp_path / "o2"))
    out = cli("status", "same-", home=home)
    assert out.returncode == 2 and "is the start of 2 job ids" in out.stderr
    assert a.id in out.stderr and b.id in out.stderr and "Traceback" not in out.stderr
    example = subprocess.run([sys.executable, "examples/analyze_results.py", "no-such-job"],
                             cwd=REPO, text=True, capture_output=True,
                             env=dict(os.environ, DFLASH_BATCH_HOME=str(home)))  # fmt: skip
    assert example.returncode == 1 and "no job 'no-such-job'" in example.stderr
    assert "Traceback" not in example.stderr


# -- item 15: a job nobody serves says so ----------------------------------------------------
def test_live_workers_by_their_heartbeat(home):
    Leases(Queue(home).huey.storage, ttl=30, clock=lambda: 1000.0).put_worker("w1", host="h")
    assert [w["id"] for w in api.live_workers(home, clock=lambda: 1010.0)] == ["w1"]
    assert api.live_workers(home, clock=lambda: 1000.0 + 3 * Leases(None).ttl + 1) == []


def test_wait_and_watch_say_no_worker_serves_the_queue(
    tmp_path, home, fake_models, monkeypatch, capsys
):
    job = queued_job(tmp_path, fake_models, PROMPTS[:2])
    with pytest.raises(TimeoutError, match="no worker is serving this queue"):
        job.wait(timeout=0)
    assert api.idle_note(job.record, "queued", workers=lambda: [{"id": "w1"}]) is None
    assert "no worker" in api.idle_note(job.record, "in_progress", workers=lambda: [])

    def poll(seconds):  # one poll, then the job is cancelled: the watch ends
        job.cancel()

    monkeypatch.setattr(time, "sleep", poll)
    assert cli_module.watch(job.record, 2.0) == 1
    assert capsys.readouterr().err.count("no worker is serving this queue") == 1


def test_watch_of_a_stopped_foreground_run_says_to_rerun(tmp_path, home, monkeypatch, capsys):
    with pytest.raises(KeyboardInterrupt):
        api.run(write_jsonl(tmp_path / "in.jsonl", PROMPTS), engine=Interrupting(FakeEngine(), 2))
    [job] = api.jobs(home)
    monkeypatch.setattr(time, "sleep", lambda seconds: job.cancel())
    assert cli_module.watch(job.record, 2.0, quiet=True) == 1
    assert "was a foreground run that stopped" in capsys.readouterr().err
