"""The runner's side of a job that adapts its drafter (issue 39), on the fake engine (no MLX): the
spec's ``adapt:`` block, the worker adapting once its rows are in, switching drafters between
tasks and naming the revision in each row, and refusing a revision that does not load."""

from __future__ import annotations

import pytest

import dflash_batch
from dflash_batch.runner import drafters
from dflash_batch.runner.jobs import load_job
from dflash_batch.runner.queue import Queue
from dflash_batch.runner.spec import SpecError, load_spec
from dflash_batch.runner.worker import Worker
from tests.fake_engine import FakeEngine
from tests.runner_fixtures import fake_models, home, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt {i}: say something"} for i in range(8)]


class SwappingEngine(FakeEngine):
    """The fake engine with ``Engine.use_drafter``'s contract: a folder without ``ok`` fails to
    load and leaves the engine as it was."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.loaded_drafter = "own"
        self.drafter_revision = None
        self.swaps = []

    def use_drafter(self, folder, revision=None):
        if folder is not None and not (folder / "ok").exists():
            raise ValueError(f"{folder}: not a drafter")
        self.drafter_revision = None if folder is None else revision
        self.swaps.append(self.drafter_revision)


def fake_adapter(calls, fail=False):
    def adapter(record, **options):
        calls.append((record.id, options, drafters.ok_rows(record)))
        if fail:
            raise RuntimeError("the adapter broke")
        name = drafters.next_name(record)
        (drafters.folder(record) / name).mkdir(parents=True)
        (drafters.folder(record) / name / "ok").touch()
        return drafters.record_attempt(record, {"revision": name, "outcome": "adopted", "trigger": options["trigger"],
                                                "held_out_before": 1.5, "held_out_after": 2.5}, adopt=True)  # fmt: skip

    return adapter


def submit(tmp_path, fake_models, **extra):
    return dflash_batch.submit(write_jsonl(tmp_path / "in.jsonl", PROMPTS), target=fake_models["target"],
                               draft=fake_models["draft"], max_tokens=3, chunk_size=2, batch_size=2, **extra)  # fmt: skip


def test_adapt_block_is_checked_and_not_in_the_hash(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    plain = load_spec(src)
    adapting = load_spec({"input": str(src), "adapt": {"after_rows": 100, "time_budget": 60}})
    assert adapting.adapt == {"after_rows": 100, "time_budget": 60}
    assert adapting.config_hash() == plain.config_hash()  # the speed changes, never the output
    for bad, said in [(5, "must be a mapping"), ({"time_budget": 5}, "after_rows"),
                      ({"after_rows": 10, "budget": 5}, "unknown key 'budget'"),
                      ({"after_rows": 0}, "after_rows must be an integer >= 1"),
                      ({"after_rows": 10, "steps": 1.5}, "steps must be an integer"),
                      ({"after_rows": 10, "time_budget": True}, "time_budget must be a number")]:  # fmt: skip
        with pytest.raises(SpecError, match=said):
            load_spec({"input": str(src), "adapt": bad})


def test_worker_adapts_once_after_enough_rows_then_drafts_with_the_revision(
    tmp_path, home, fake_models
):
    job = submit(tmp_path, fake_models, adapt={"after_rows": 4, "time_budget": 30})
    engine, calls = SwappingEngine(batch=2), []
    worker = Worker(Queue(home), lambda **model: engine, adapter=fake_adapter(calls))
    worker.chunks_to_run = lambda record, chunk: [chunk]  # one chunk a task: 2 rows
    worker.run_chunk(job.id, 0)
    assert calls == []  # 2 rows: not yet
    worker.run_chunk(job.id, 1)
    assert calls == [(job.id, {"trigger": "spec", "after_rows": 4, "time_budget": 30}, 4)]
    record = load_job(home, job.id)
    assert (
        drafters.in_force(record)[0] == "rev-0001" and not worker.held
    )  # adapted with no lease held
    worker.run_chunk(job.id, 2)
    worker.run_chunk(job.id, 3)
    assert len(calls) == 1  # once
    revisions = {r["id"]: r["drafter_revision"] for r in record.store().read().to_pylist()}
    assert [revisions[f"p{i}"] for i in range(8)] == [None] * 4 + ["rev-0001"] * 4
    assert engine.swaps == ["rev-0001"]
    drafted = job.status()["drafter"]["drafted"]
    assert drafted["job"]["rows"] == 4 and drafted["rev-0001"]["rows"] == 4


def test_a_failing_adaptation_is_recorded_and_the_job_goes_on(tmp_path, home, fake_models):
    job = submit(tmp_path, fake_models, adapt={"after_rows": 2})
    engine, calls = SwappingEngine(batch=2), []
    worker = Worker(Queue(home), lambda **model: engine, adapter=fake_adapter(calls, fail=True))
    worker.chunks_to_run = lambda record, chunk: [chunk]
    for c in range(4):
        worker.run_chunk(job.id, c)
    assert len(calls) == 1 and job.status()["state"] == "completed"
    history = drafters.state(load_job(home, job.id))["history"]
    assert [(h["outcome"], h["note"]) for h in history] == [
        ("failed", "RuntimeError: the adapter broke")
    ]


def test_a_revision_that_does_not_load_is_refused_and_the_one_before_kept(
    tmp_path, home, fake_models
):
    job = submit(tmp_path, fake_models)
    record = load_job(home, job.id)
    adapter = fake_adapter([])
    adapter(record, trigger="cli")  # rev-0001, loads
    adapter(record, trigger="cli")  # rev-0002, in force, but damaged:
    (drafters.folder(record) / "rev-0002" / "ok").unlink()
    engine = SwappingEngine(batch=2)
    worker = Worker(Queue(home), lambda **model: engine)
    worker.run_chunk(job.id, 0)
    assert drafters.in_force(record)[0] == "rev-0001"
    assert [h["outcome"] for h in drafters.state(record)["history"]] == ["adopted", "refused"]
    assert set(job.to_pandas()["drafter_revision"]) == {"rev-0001"}
    lines = "\n".join(drafters.summary_lines(job.status()["drafter"]))
    assert "rev-0002 refused" in lines and "in force: rev-0001" in lines
