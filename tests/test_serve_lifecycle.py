"""A batch's status follows its job's state (dflash_batch/server/batches.py), checked in this
process with Starlette's test client, an injected clock and the fake engine: expiry when the
completion window passes, cancel of a queued batch, a failed job, a removed job."""

from __future__ import annotations

import pytest

from dflash_batch import api
from dflash_batch.runner.execution import run_chunk
from dflash_batch.runner.jobs import load_job
from tests.fake_engine import FakeEngine
from tests.runner_fixtures import home  # noqa: F401
from tests.serve_fixtures import CHAT, jsonl, request_line

TestClient = pytest.importorskip("starlette.testclient").TestClient
DAY = 24 * 3600


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def served(home):  # noqa: F811
    from dflash_batch.server.app import create_app

    clock = Clock()
    app = create_app(home, submit=api.submit, clock=clock, overrides={"chunk_size": 2})
    return TestClient(app), clock


def make_batch(client, n: int) -> dict:
    lines = [request_line(f"r-{i}", f"prompt {i}") for i in range(n)]
    answer = client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", jsonl(lines))}
    )
    assert answer.status_code == 200, answer.text
    body = {"input_file_id": answer.json()["id"], "endpoint": CHAT, "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body).json()
    assert batch["status"] == "in_progress", batch
    return batch


def lines_of(client, file_id) -> list:
    import json

    text = client.get(f"/v1/files/{file_id}/content").text
    return [json.loads(ln) for ln in text.splitlines()]


def test_the_window_passing_expires_the_batch_with_what_finished(served, home):  # noqa: F811
    client, clock = served
    batch = make_batch(client, 6)
    job = load_job(home, batch["dflash"]["job_id"])
    run_chunk(job, 0, lambda spec: FakeEngine())  # two of six requests done
    assert batch["expires_at"] == batch["created_at"] + DAY
    clock.now += DAY - 1
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
    clock.now += 1
    expired = client.get(f"/v1/batches/{batch['id']}").json()
    assert expired["status"] == "expired" and expired["expired_at"] == int(clock.now)
    assert expired["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    output = lines_of(client, expired["output_file_id"])
    assert [ln["custom_id"] for ln in output] == ["r-0", "r-1"]
    errors = lines_of(client, expired["error_file_id"])
    assert [ln["custom_id"] for ln in errors] == [f"r-{i}" for i in range(2, 6)]
    assert {ln["error"]["code"] for ln in errors} == {"batch_expired"}
    assert job.cancelled()  # a worker drops the chunks that remain


def test_cancel_of_a_queued_batch_ends_cancelled_at_once(served, home):  # noqa: F811
    client, clock = served
    batch = make_batch(client, 3)
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"  # no worker holds it: nothing to wait for
    assert cancelled["output_file_id"] is None and cancelled["request_counts"]["completed"] == 0
    clock.now += 2 * DAY
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "cancelled"
    assert client.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelled"


def test_a_completed_batch_cannot_be_cancelled(served, home):  # noqa: F811
    client, _ = served
    batch = make_batch(client, 1)
    run_chunk(load_job(home, batch["dflash"]["job_id"]), 0, lambda spec: FakeEngine())
    assert client.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed"
    refused = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_state"


def test_a_failed_job_fails_its_batch_naming_the_error(served, home):  # noqa: F811
    client, _ = served
    batch = make_batch(client, 2)
    load_job(home, batch["dflash"]["job_id"]).mark_failed("RuntimeError: the model went away")
    failed = client.get(f"/v1/batches/{batch['id']}").json()
    assert failed["status"] == "failed" and failed["failed_at"] is not None
    assert "the model went away" in failed["errors"]["data"][0]["message"]


def test_a_removed_job_fails_its_batch_instead_of_breaking_the_list(served, home):  # noqa: F811
    client, _ = served
    batch = make_batch(client, 1)
    load_job(home, batch["dflash"]["job_id"]).mark_cancelled()
    api.remove([batch["dflash"]["job_id"]], home=home)
    listed = client.get("/v1/batches").json()["data"]
    assert [b["status"] for b in listed] == ["failed"]
    assert listed[0]["errors"]["data"][0]["code"] == "job_gone"


def test_an_unknown_route_and_method_answer_in_openai_shape(served):
    client, _ = served
    for answer in (client.get("/v1/nothing"), client.put("/v1/batches")):
        assert answer.status_code in (404, 405)
        assert answer.json()["error"]["type"] == "invalid_request_error"


def test_metadata_and_list_parameters_are_checked(served, home):  # noqa: F811
    client, _ = served
    batch = make_batch(client, 1)
    file_id = batch["input_file_id"]
    too_many = {f"k{i}": "v" for i in range(17)}
    for metadata in (too_many, {"k": 1}, ["k"], {"k" * 65: "v"}):
        body = {
            "input_file_id": file_id,
            "endpoint": CHAT,
            "completion_window": "24h",
            "metadata": metadata,
        }
        answer = client.post("/v1/batches", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "metadata"
    for query in ("limit=0", "limit=101", "limit=x", "after=batch_nothing"):
        answer = client.get(f"/v1/batches?{query}")
        assert answer.status_code == 400, query
    assert client.get("/v1/files?order=sideways").status_code == 400
    assert len(client.get("/v1/batches").json()["data"]) == 1  # the refused made none
