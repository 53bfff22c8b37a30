"""The worker's chunk task in process, on the fake engine (no MLX): the engine stays full across
chunk boundaries, and jobs still interleave when several wait."""

from __future__ import annotations

import dflash_batch
from dflash_batch.runner.jobs import load_job
from dflash_batch.runner.queue import Queue, task_id
from dflash_batch.runner.worker import Worker
from tests.fake_engine import FakeEngine
from tests.runner_fixtures import fake_models, home, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt {i}: say something"} for i in range(8)]


def submit(tmp_path, fake_models, name):
    return dflash_batch.submit(write_jsonl(tmp_path / f"{name}.jsonl", PROMPTS), target=fake_models["target"],
                               draft=fake_models["draft"], max_tokens=3, chunk_size=2, batch_size=8)  # fmt: skip


def test_one_task_feeds_the_jobs_pending_chunks_as_one_stream(tmp_path, home, fake_models):
    job = submit(tmp_path, fake_models, "a")
    engine = FakeEngine(batch=8)
    worker = Worker(Queue(home), lambda **model: engine)
    worker.run_chunk(job.id, 0)
    # one call, half of the four chunks' rows in it (the other half stays free for a second
    # worker): one batch of 4 rows, not two batches of 2
    assert len(engine.batch_sizes) == 1 and len(engine.requests) == 4
    record = load_job(home, job.id)
    assert record.pending_chunks() == [2, 3]
    # the other chunks' tasks are still queued; one whose chunk is done generates nothing
    assert Queue(home).queued_task_ids() >= {task_id(job.id, c) for c in (1, 2, 3)}
    worker.run_chunk(job.id, 1)
    assert len(engine.requests) == 4
    worker.run_chunk(job.id, 2)
    worker.run_chunk(job.id, 3)
    assert (
        len(engine.requests) == 8
        and job.status()["state"] == "completed"
        and job.to_pandas()["id"].is_unique
    )


def test_with_another_job_waiting_a_task_runs_only_its_chunk(tmp_path, home, fake_models):
    first, second = submit(tmp_path, fake_models, "a"), submit(tmp_path, fake_models, "b")
    engine = FakeEngine(batch=8)
    worker = Worker(Queue(home), lambda **model: engine)
    worker.run_chunk(first.id, 0)
    assert len(engine.requests) == 2 and load_job(home, first.id).pending_chunks() == [1, 2, 3]
    assert second.status()["done"] == 0


def test_the_worker_warms_up_before_its_chunk_and_says_so(tmp_path, home, fake_models, caplog):
    """The engine's warm-up (``prepare``) runs at the job's batch size and budget before the
    chunk's first item, and the worker's log says what it cost and where the costs came from."""
    job = submit(tmp_path, fake_models, "warm")
    events = []

    class Warming(FakeEngine):
        def prepare(self, batch_size=None, max_tokens=0):
            events.append(("prepare", batch_size, max_tokens))
            return {
                "batch_size": batch_size,
                "context": 64 + max_tokens // 2,
                "seconds": 0.25,
                "read": True,
            }

        def generate_requests(self, requests, batch_size=None):
            events.append(("generate", batch_size))
            return super().generate_requests(requests, batch_size)

    worker = Worker(Queue(home), lambda **model: Warming(batch=8))
    with caplog.at_level("INFO", logger="dflash_batch.worker"):
        worker.run_chunk(job.id, 0)
    assert events[:2] == [("prepare", 8, 3), ("generate", 8)]
    assert any(
        "warmed up for batch size 8" in r.message and "read from the model cache" in r.message
        for r in caplog.records
    )
