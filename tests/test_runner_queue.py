"""The queue for real: SqliteHuey on a real file, `dflash-batch worker` processes started here,
a real tiny engine. Kill -9 and resume, two workers on one job, graceful stop, cancel, cron."""

from __future__ import annotations

import datetime
import signal
import time

import pandas as pd
import pytest

import dflash_batch
from dflash_batch import api
from dflash_batch.runner.cron import Cron
from dflash_batch.runner.lock import is_locked
from dflash_batch.runner.queue import Queue
from dflash_batch.runner.store import ResultStore
from tests.runner_fixtures import (  # noqa: F401
    cli,
    fake_models,
    home,
    tiny_models,
    wait_for,
    workers,
    write_jsonl,
)

pytestmark = pytest.mark.slow


def prompts(n, words=3):
    return [
        {"id": f"item-{i:03d}", "prompt": f"Item {i}: " + "tell me more " * words} for i in range(n)
    ]


def model(tiny_models, **kw):
    return dict(target=tiny_models["target"], draft=tiny_models["draft"], **kw)


def done(job):
    return job.status()["done"]


def test_submit_worker_pandas_and_resident_engine(tmp_path, home, tiny_models, workers):
    first = dflash_batch.submit(
        write_jsonl(tmp_path / "a.jsonl", prompts(5)),
        **model(tiny_models, max_tokens=8, chunk_size=2),
    )
    second = dflash_batch.submit(
        write_jsonl(tmp_path / "b.jsonl", prompts(3)), **model(tiny_models, max_tokens=8)
    )
    assert first.status()["state"] == "queued"
    w = workers(
        "--target", tiny_models["target"], "--draft", tiny_models["draft"]
    )  # preloaded at start
    assert first.wait(timeout=240)["state"] == "completed"
    assert second.wait(timeout=240)["state"] == "completed"
    df = pd.read_parquet(first.output_dir)
    assert sorted(df["id"]) == [f"item-{i:03d}" for i in range(5)] and (df["status"] == "ok").all()
    assert df["decode_tps"].gt(0).all() and df["verify_cycles"].gt(0).all()
    # a rate where the row's cycles drafted, null where the width policy decoded it plainly
    assert (df["acceptance_drafted"].notna() == df["drafted_tokens"].gt(0)).all()
    status = cli("status", first.id, "--json", home=home, check=True).stdout
    assert '"state": "completed"' in status and '"mean_decode_tps"' in status
    log = w.log()
    assert (
        log.count("loading engine") == 1 and "in thread Worker-1" in log
    )  # loaded once, in the worker thread
    assert log.index("engine ready") < log.index(
        "Executing"
    )  # by the start-up hook, before any job
    assert w.stop() == 0


def test_kill_9_mid_job_then_restart_every_id_exactly_once(tmp_path, home, tiny_models, workers):
    n = 40
    rows = [
        dict(row, max_tokens=16 + 16 * (i % 4)) for i, row in enumerate(prompts(n, words=20))
    ]  # rows of a batch end apart
    job = dflash_batch.submit(
        write_jsonl(tmp_path / "in.jsonl", rows), **model(tiny_models, chunk_size=12, batch_size=4)
    )
    store = ResultStore(job.output_dir)
    w = workers()

    # Kill while finished rows sit in a journal (not just after a chunk became a part): rows of a
    # batch can finish together, so "3 done" alone may land right after a commit. Each look is
    # taken with the worker paused, so no commit can fall between the look and the kill (and
    # reads only files: a paused worker may hold the SQLite lock).
    def paused_mid_journal():
        w.pause()
        if len(store.journal_rows()) >= 3:
            return True
        w.resume()
        return False

    wait_for(paused_mid_journal, timeout=240, interval=0.02, what="first items in a journal")
    w.kill9()
    before = {r["id"]: r["started_at"] for r in store.journal_rows()}
    before.update(
        {r["id"]: r["started_at"].timestamp() for r in store.read(["id", "started_at"]).to_pylist()}
    )
    assert 3 <= len(before) < n, "the worker must die mid-job for this test to mean anything"
    assert store.journals(), "rows finished since the last part live in the journal"
    w2 = workers()
    assert job.wait(timeout=300)["state"] == "completed"
    df = pd.read_parquet(job.output_dir)
    assert (
        len(df) == n and df["id"].is_unique and set(df["id"]) == {f"item-{i:03d}" for i in range(n)}
    )
    after = dict(zip(df["id"], (t.timestamp() for t in df["started_at"])))
    assert all(
        after[i] == pytest.approx(t, abs=1e-5) for i, t in before.items()
    )  # finished items were not regenerated
    assert "requeued" in w2.log()
    assert w2.stop() == 0


def test_two_workers_on_one_job(tmp_path, home, tiny_models, workers):
    job = dflash_batch.submit(
        write_jsonl(tmp_path / "in.jsonl", prompts(18)),
        **model(tiny_models, max_tokens=12, chunk_size=3),
    )
    a, b = workers(), workers()
    assert job.wait(timeout=300)["state"] == "completed"
    df = job.to_pandas()
    assert len(df) == 18 and df["id"].is_unique
    assert a.stop() == 0 and b.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_stop_checkpoints_and_requeues_the_current_chunk(
    tmp_path, home, tiny_models, workers, sig
):
    n = 30
    job = dflash_batch.submit(
        write_jsonl(tmp_path / "in.jsonl", prompts(n, words=20)),
        **model(tiny_models, max_tokens=48, chunk_size=30),
    )
    w = workers()
    wait_for(lambda: done(job) >= 2, timeout=240, interval=0.05, what="first items")
    assert w.stop(sig) == 0
    store = ResultStore(job.output_dir)
    assert not store.journals(), "a graceful stop commits the journal to a part"
    committed = len(store.committed_ids())
    assert 2 <= committed < n
    assert f"{job.id}:00000" in Queue(home).queued_task_ids()
    assert "checkpointed" in w.log()
    workers()
    assert job.wait(timeout=300)["state"] == "completed"
    df = job.to_pandas()
    assert len(df) == n and df["id"].is_unique


def test_cancel_stops_between_items_and_retry_finishes(
    tmp_path, home, fake_models, workers, monkeypatch
):
    """The fake engine holds its first step while a file exists (``FAKE_ENGINE_HOLD``), so the
    cancel lands while the job runs, however fast the machine: with the tiny real engine a
    loaded machine's ``dflash-batch cancel`` once started after the whole job had finished."""
    n = 30
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv("FAKE_ENGINE_HOLD", str(hold))
    job = dflash_batch.submit(
        write_jsonl(tmp_path / "in.jsonl", prompts(n, words=20)),
        **model(fake_models, max_tokens=48, chunk_size=5),
    )
    w = workers()
    wait_for(lambda: any(tmp_path.glob("hold.*")), timeout=240, what="the job's first step")
    assert cli("cancel", job.id, home=home, check=True).returncode == 0
    hold.unlink()
    status = job.wait(timeout=120)
    assert status["state"] == "cancelled" and status["done"] < n
    wait_for(
        lambda: not is_locked(job.output_dir),
        timeout=120,
        what="the worker to leave the cancelled job",
    )
    stopped_at = done(job)
    time.sleep(2)
    assert done(job) == stopped_at < n  # nothing more is generated for a cancelled job
    out = cli("retry", job.id, home=home, check=True)
    assert "queued" in out.stdout
    assert job.wait(timeout=300)["state"] == "completed"
    assert len(job.to_pandas()) == n and job.to_pandas()["id"].is_unique
    assert w.proc.poll() is None  # the worker kept running through cancel and retry
    assert w.stop() == 0


def test_job_level_failure_is_reported_and_the_worker_goes_on(tmp_path, home, tiny_models, workers):
    bad = dflash_batch.submit(
        write_jsonl(tmp_path / "a.jsonl", prompts(2)),
        target=str(tmp_path / "no-model"),
        draft="none",
    )
    good = dflash_batch.submit(
        write_jsonl(tmp_path / "b.jsonl", prompts(2)), **model(tiny_models, max_tokens=4)
    )
    w = workers()
    status = bad.wait(timeout=240)
    assert status["state"] == "failed" and "no-model" in status["error"]
    assert good.wait(timeout=240)["state"] == "completed"
    assert w.stop() == 0


def test_cron_schedule_from_yaml(tmp_path, home, tiny_models, workers):
    write_jsonl(tmp_path / "docs.jsonl", prompts(2))
    spec = tmp_path / "nightly.yaml"
    spec.write_text(
        f"name: nightly\ninput: docs.jsonl\nschedule: '0 2 * * *'\nmodel: {{target: {tiny_models['target']}, "
        f"draft: {tiny_models['draft']}}}\nsampling: {{max_tokens: 4}}\noutput_dir: out/{{date}}\n"
    )
    out = cli("submit", spec, home=home, check=True)
    assert "scheduled 'nightly' at '0 2 * * *'" in out.stdout
    assert (home / "schedules" / "nightly.yaml").exists() and not (home / "jobs").exists()
    # The schedule as a worker registers it: a Huey periodic task due at 02:00 UTC only.
    cron = Cron(Queue(home))
    assert cron.add_schedule(home / "schedules" / "nightly.yaml") == ("nightly", "0 2 * * *")
    due = cron.queue.huey.read_periodic(datetime.datetime(2026, 1, 1, 2, 0))
    assert [t.name for t in due] == ["dflash_batch.cron.nightly"]
    assert cron.queue.huey.read_periodic(datetime.datetime(2026, 1, 1, 2, 1)) == []
    cron.queue.huey.execute(due[0])  # what the consumer does when the minute comes: submit the job
    [record] = api.jobs(home)
    assert (
        record.record.spec.schedule == "0 2 * * *" and record.output_dir.parent == tmp_path / "out"
    )
    # A real worker registers it from the home's schedules and runs the submitted job.
    w = workers()
    assert record.wait(timeout=240)["state"] == "completed"
    assert "schedule registered: nightly at '0 2 * * *' (UTC)" in w.log()
    assert w.stop() == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: docs.jsonl\nschedule: '0 2 * *'\n")
    refused = cli("worker", "--schedules", bad, home=home, timeout=120)
    assert (
        refused.returncode == 2 and "need 5 fields" in refused.stderr and str(bad) in refused.stderr
    )


def test_last_due_finds_the_latest_matching_minute():
    from dflash_batch.runner.cron import CATCH_UP_DAYS, last_due

    t = datetime.datetime
    assert last_due("0 2 * * *", t(2026, 1, 1, 3, 0), t(2026, 1, 3, 1, 0)) == t(2026, 1, 2, 2, 0)
    assert (
        last_due("0 2 * * *", t(2026, 1, 2, 2, 0), t(2026, 1, 3, 1, 59)) is None
    )  # (since, now]: ran at 02:00
    assert last_due("*/15 * * * *", t(2026, 1, 1), t(2026, 1, 1, 10, 44, 59)) == t(
        2026, 1, 1, 10, 30
    )
    assert last_due("0 2 * * *", t(2025, 1, 1), t(2026, 1, 3, 1, 0)) == t(2026, 1, 2, 2, 0)
    # a run older than the look-back is not made up for
    assert (
        last_due(
            "0 0 1 1 *", t(2024, 6, 1), t(2026, 1, 1) + datetime.timedelta(days=CATCH_UP_DAYS + 1)
        )
        is None
    )


def test_missed_cron_run_is_submitted_once_at_worker_start(tmp_path, home, tiny_models):
    import os

    write_jsonl(tmp_path / "docs.jsonl", prompts(2))
    spec = tmp_path / "nightly.yaml"
    spec.write_text(
        f"name: nightly\ninput: docs.jsonl\nschedule: '0 2 * * *'\n"
        f"model: {{target: {tiny_models['target']}}}\noutput_dir: out/{{date}}\n"
    )
    cli("submit", spec, home=home, check=True)
    registered = home / "schedules" / "nightly.yaml"
    t = datetime.datetime
    day0 = t(2026, 3, 1, 12, 0)  # registered at noon on day 0
    os.utime(registered, (day0.replace(tzinfo=datetime.timezone.utc).timestamp(),) * 2)

    queue = Cron(Queue(home))
    queue.add_schedule(registered)
    assert (
        queue.catch_up(now=t(2026, 3, 2, 1, 0)) == []
    )  # the first due time (day 1, 02:00) is still ahead
    # no worker from then until day 4, 09:00: three nightly runs missed, one job submitted
    [record] = queue.catch_up(now=t(2026, 3, 4, 9, 0))
    assert [j.id for j in api.jobs(home)] == [record.id]
    assert queue.last_run("nightly") == t(2026, 3, 4, 9, 0)
    assert queue.catch_up(now=t(2026, 3, 4, 9, 5)) == []  # nothing new is due
    assert queue.catch_up(now=t(2026, 3, 5, 2, 30)) != []  # day 5's run was missed too
    # the cron tick in the same minute as a start-up catch-up does not submit the job again
    from dflash_batch.runner.cron import utcnow

    queue.submit_schedule("nightly", registered, utcnow())
    n = len(api.jobs(home))
    [tick] = queue.queue.huey.read_periodic(t(2026, 3, 6, 2, 0))
    queue.queue.huey.execute(tick)
    assert len(api.jobs(home)) == n

    # an input that has gone away: the missed run is logged, not raised (the worker must start)
    (tmp_path / "docs.jsonl").unlink()
    (home / "schedules" / ".last-run" / "nightly").unlink()  # due again since day 0
    assert queue.catch_up(now=t(2026, 3, 9, 3, 0)) == []
    write_jsonl(tmp_path / "docs.jsonl", prompts(2))

    off = tmp_path / "weekly.yaml"
    off.write_text(
        f"name: weekly\ninput: docs.jsonl\nschedule: '@weekly'\ncatch_up: false\n"
        f"model: {{target: {tiny_models['target']}}}\n"
    )
    cli("submit", off, home=home, check=True)
    os.utime(
        home / "schedules" / "weekly.yaml",
        (day0.replace(tzinfo=datetime.timezone.utc).timestamp(),) * 2,
    )
    queue = Cron(Queue(home))
    queue.add_schedule(home / "schedules" / "weekly.yaml")
    assert queue.catch_up(now=t(2026, 3, 20)) == []  # missed, but catch_up is off
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: docs.jsonl\nschedule: '@daily'\ncatch_up: maybe\n")
    refused = cli("submit", bad, home=home)
    assert (
        refused.returncode == 2
        and "catch_up" in refused.stderr
        and "true or false" in refused.stderr
    )


def test_worker_start_catches_up_a_missed_run(tmp_path, home, tiny_models, workers):
    import os

    write_jsonl(tmp_path / "docs.jsonl", prompts(2))
    spec = tmp_path / "nightly.yaml"
    spec.write_text(
        f"name: nightly\ninput: docs.jsonl\nschedule: '@daily'\nsampling: {{max_tokens: 4}}\n"
        f"model: {{target: {tiny_models['target']}, draft: {tiny_models['draft']}}}\n"
    )
    cli("submit", spec, home=home, check=True)
    two_days_ago = time.time() - 2 * 86400
    os.utime(home / "schedules" / "nightly.yaml", (two_days_ago, two_days_ago))
    w = workers()
    wait_for(lambda: api.jobs(home), timeout=120, what="the caught-up job")
    [job] = api.jobs(home)
    assert job.wait(timeout=240)["state"] == "completed"
    assert "schedule nightly missed its run at" in w.log() and "submitting it now" in w.log()
    assert w.stop() == 0
    (home / "schedules" / ".last-run" / "nightly").unlink()  # missed again, as far as state goes
    os.utime(home / "schedules" / "nightly.yaml", (two_days_ago, two_days_ago))
    w = workers("--no-periodic")  # only the worker that runs the cron catches up
    wait_for(lambda: "worker started" in w.log(), timeout=120, what="the second worker")
    time.sleep(1)
    assert len(api.jobs(home)) == 1
    assert w.stop() == 0


def test_redis_queue_submit_and_worker(
    tmp_path, home, tiny_models, workers, redis_url, monkeypatch
):
    monkeypatch.setenv("DFLASH_BATCH_REDIS_URL", redis_url)  # for the CLI processes started below
    job = dflash_batch.submit(
        write_jsonl(tmp_path / "in.jsonl", prompts(6)),
        **model(tiny_models, max_tokens=6, chunk_size=2),
    )
    queue = Queue(home)
    assert queue.broker == redis_url and len(queue.queued_task_ids()) == 3
    assert not (home / "queue.db").exists()  # the tasks went to Redis, not to SQLite
    w = workers()
    assert job.wait(timeout=240)["state"] == "completed"
    assert f"worker started: queue {redis_url}" in w.log()
    assert sorted(pd.read_parquet(job.output_dir)["id"]) == [f"item-{i:03d}" for i in range(6)]
    assert w.stop() == 0
    # --redis on the command line does the same as the environment variable
    monkeypatch.delenv("DFLASH_BATCH_REDIS_URL")
    out = cli(
        "--redis",
        redis_url,
        "submit",
        tmp_path / "in.jsonl",
        "--target",
        tiny_models["target"],
        "--max-tokens",
        "4",
        "--output-dir",
        tmp_path / "second",
        home=home,
        check=True,
    )
    assert len(Queue(home, redis_url=redis_url).queued_task_ids()) == 1 and "queued" in out.stderr
    assert Queue(home).queued_task_ids() == set()  # the SQLite queue of this home is empty
    # and from Python, without the variable
    dflash_batch.submit(
        tmp_path / "in.jsonl",
        home=home,
        redis_url=redis_url,
        target=tiny_models["target"],
        max_tokens=4,
        output_dir=str(tmp_path / "third"),
    )
    assert (
        len(Queue(home, redis_url=redis_url).queued_task_ids()) == 2
        and Queue(home).queued_task_ids() == set()
    )


def test_one_engine_for_a_preloaded_model_named_another_way(tmp_path, home, tiny_models, workers):
    """`worker --draft off` and a job's `--no-draft` (or `draft: none`) are one request: the
    resident engine is loaded once and serves the job."""
    job = dflash_batch.submit(write_jsonl(tmp_path / "a.jsonl", prompts(2)), target=tiny_models["target"], draft="none",
                              max_tokens=4)  # fmt: skip
    w = workers("--target", tiny_models["target"], "--draft", "off")
    assert job.wait(timeout=240)["state"] == "completed"
    log = w.log()
    assert log.count("loading engine") == 1 and log.count("engine ready") == 1, log
    assert 'startup hook "dflash_batch.load_engine" failed' not in log
    assert w.stop() == 0


def test_schedules_are_listed_and_removed(tmp_path, home):
    write_jsonl(tmp_path / "docs.jsonl", prompts(2))
    (tmp_path / "nightly.yaml").write_text(
        "name: nightly\ninput: docs.jsonl\nschedule: '0 2 * * *'\n"
    )
    (tmp_path / "weekly.yaml").write_text(
        "input: docs.jsonl\nschedule: '@weekly'\ncatch_up: false\n"
    )
    assert "no schedules registered" in cli("schedules", home=home, check=True).stdout
    cli("submit", tmp_path / "nightly.yaml", home=home, check=True)
    cli("submit", tmp_path / "weekly.yaml", home=home, check=True)
    listed = {
        s["name"]: s
        for s in __import__("json").loads(cli("schedules", "--json", home=home, check=True).stdout)
    }
    assert sorted(listed) == ["nightly", "weekly"]
    assert listed["nightly"]["schedule"] == "0 2 * * *" and listed["nightly"]["last_run"] is None
    assert (
        listed["nightly"]["next_run"].endswith("T02:00") and listed["weekly"]["catch_up"] is False
    )
    assert listed["nightly"]["input"] == str(tmp_path / "docs.jsonl")
    text = cli("schedules", home=home, check=True).stdout
    assert "nightly  '0 2 * * *' (UTC)  last run never" in text
    cron = Cron(Queue(home))
    cron.add_schedule(home / "schedules" / "nightly.yaml")
    cron.submit_schedule(
        "nightly", home / "schedules" / "nightly.yaml", datetime.datetime(2026, 3, 1, 2, 0)
    )
    assert api.schedules(home)[0]["last_run"] == "2026-03-01T02:00:00"
    out = cli("unschedule", "nightly", home=home, check=True)
    assert "removed schedule 'nightly'" in out.stdout and "restart" in out.stdout
    assert not (home / "schedules" / "nightly.yaml").exists()
    assert not (home / "schedules" / ".last-run" / "nightly").exists()
    assert [s["name"] for s in api.schedules(home)] == ["weekly"]
    again = cli("unschedule", "nightly", home=home)
    assert again.returncode == 4 and "no schedule 'nightly'" in again.stderr
    (home / "schedules" / "broken.yaml").write_text("input: [\n")
    assert "unreadable" in cli("schedules", home=home, check=True).stdout
