"""``dflash-batch serve`` driven by OpenAI's own Python client over loopback, with the fake
engine (tests/fake_engine.py) in the workers: upload, create, poll, download and parse with the
client's types; cancel; pagination; bad requests refused in OpenAI's shape, changing nothing;
the API key rule; a worker killed with -9 mid-batch."""

from __future__ import annotations

import collections
import json

import pytest

from tests.runner_fixtures import cli, fake_models, home, wait_for, workers  # noqa: F401
from tests.serve_fixtures import (  # noqa: F401
    CHAT,
    httpx,
    job_records,
    jsonl,
    lines_of,
    openai,
    request_line,
    servers,
    stored_files,
    wait_batch,
)

ChatCompletion = openai.types.chat.ChatCompletion
Completion = openai.types.Completion


def upload(client, lines, name="requests.jsonl"):
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def test_batch_round_trip_with_the_openai_client(servers):
    server = servers("--worker", "--chunk-size", "2")
    client = server.client
    lines = [request_line(f"req-{i}", f"prompt number {i}") for i in range(5)]
    lines.insert(2, dict(request_line("bad-body"), body={"max_tokens": 3}))  # no messages
    source = upload(client, lines)
    assert source.purpose == "batch" and source.filename == "requests.jsonl"
    assert client.files.retrieve(source.id).bytes == len(jsonl(lines))
    assert client.files.content(source.id).content == jsonl(lines)

    batch = client.batches.create(
        input_file_id=source.id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"run": "round-trip"},
    )
    assert batch.status == "in_progress" and batch.metadata == {"run": "round-trip"}
    client.files.delete(source.id)  # the batch keeps its own copy of the input
    batch, seen = wait_batch(client, batch.id)
    assert batch.status == "completed", (seen, server.log())
    assert set(seen) <= {"in_progress", "finalizing", "completed"}
    assert batch.request_counts.total == 6
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    assert batch.model == "SmolLM2-135M-Instruct"

    output = lines_of(client, batch.output_file_id)
    assert [ln["custom_id"] for ln in output] == [f"req-{i}" for i in range(5)]
    for line in output:
        body = line["response"]["body"]
        completion = ChatCompletion.model_validate(body)  # the client's own type
        assert completion.choices[0].message.content
        assert completion.usage.completion_tokens == 4
        stats = body["dflash"]  # the documented extension key
        assert stats["acceptance_drafted"] > 0 and stats["verify_cycles"] > 0
        assert stats["target_passes_saved"] == 3 - stats["verify_cycles"]
        assert sum(stats["acceptance_histogram"]) == stats["verify_cycles"]
    errors = lines_of(client, batch.error_file_id)
    assert [ln["custom_id"] for ln in errors] == ["bad-body"]
    assert errors[0]["response"] is None and "messages" in errors[0]["error"]["message"]

    files = client.files.list(purpose="batch_output")
    assert {f.id for f in files} == {batch.output_file_id, batch.error_file_id}
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(source.id)


def test_completions_endpoint_answers_in_its_own_shape(servers):
    client = servers("--worker").client
    source = upload(client, [request_line("t-1", "once upon", url="/v1/completions")])
    batch = client.batches.create(
        input_file_id=source.id, endpoint="/v1/completions", completion_window="24h"
    )
    batch, _ = wait_batch(client, batch.id)
    [line] = lines_of(client, batch.output_file_id)
    assert Completion.model_validate(line["response"]["body"]).choices[0].text


def test_an_input_for_another_endpoint_fails_the_batch_as_a_whole(servers, home):
    client = servers().client
    source = upload(client, [request_line("a"), request_line("b", url="/v1/completions")])
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors.data[0].code == "mismatched_endpoint"
    assert "/v1/completions" in batch.errors.data[0].message
    assert job_records(home) == []  # nothing was queued


def test_cancel_mid_run(servers, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.4")
    monkeypatch.setenv("FAKE_ENGINE_BATCH", "1")
    client = servers("--worker", "--chunk-size", "2").client
    source = upload(client, [request_line(f"c-{i}", f"prompt {i}") for i in range(30)])
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    wait_for(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2,
        timeout=120,
        what="two requests done",
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch, seen = wait_batch(client, batch.id)
    assert batch.status == "cancelled", seen
    assert "in_progress" not in seen and batch.cancelled_at >= batch.cancelling_at
    done = lines_of(client, batch.output_file_id)
    assert 2 <= len(done) < 30
    assert batch.request_counts.completed == len(done)
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change


def test_list_batches_with_pagination(servers):
    client = servers().client  # no worker: the batches stay in progress
    source = upload(client, [request_line("p")])
    made = [
        client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h").id
        for _ in range(5)
    ]
    first = client.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    assert [b.id for b in client.batches.list(limit=2)] == list(reversed(made))  # auto-paging
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == list(reversed(made))[2:4]
    assert len(client.files.list(limit=1).data) == 1


def test_models_lists_the_target_and_its_drafter(servers, fake_models):
    client = servers("--target", "org/some-target", "--draft", "org/some-drafter").client
    models = client.models.list().data
    assert [m.id for m in models] == ["org/some-target", "org/some-drafter"]
    assert all(m.object == "model" and m.owned_by == "dflash-batch" for m in models)


def test_bad_requests_are_refused_in_openai_shape_and_change_nothing(servers, home):
    server = servers("--max-requests-per-file", "3", "--max-file-bytes", "2000")
    client = server.client
    good = upload(client, [request_line("ok-1")])
    before = (stored_files(home), job_records(home))

    def refused(call, code, status=openai.BadRequestError):
        with pytest.raises(status) as caught:
            call()
        body = caught.value.body
        assert set(body) >= {"message", "type", "param", "code"}, body
        assert body["code"] == code, body
        assert (stored_files(home), job_records(home)) == before
        return body

    refused(lambda: client.batches.create(input_file_id="file-" + "0" * 24, endpoint=CHAT,
                                          completion_window="24h"), "not_found",
            openai.NotFoundError)  # fmt: skip
    refused(
        lambda: client.files.create(
            file=("x.jsonl", jsonl([request_line("a")])), purpose="fine-tune"
        ),
        "invalid_purpose",
    )
    refused(lambda: upload(client, [request_line(f"n-{i}") for i in range(4)]), "too_many_requests")
    refused(lambda: upload(client, [request_line("big", "word " * 500)]), "file_too_large")
    refused(lambda: upload(client, [request_line("a"), "{not json"]), "invalid_jsonl")
    refused(lambda: upload(client, ["[1, 2]"]), "invalid_jsonl")
    body = refused(
        lambda: upload(client, [request_line("same"), request_line("same")]), "duplicate_custom_id"
    )
    assert "line 2" in body["message"] and "line 1" in body["message"]
    refused(lambda: upload(client, []), "empty_file")
    refused(
        lambda: client.batches.create(
            input_file_id=good.id, endpoint="/v1/embeddings", completion_window="24h"
        ),
        "unsupported_endpoint",
    )
    refused(
        lambda: client.batches.create(
            input_file_id=good.id, endpoint=CHAT, completion_window="48h"
        ),
        "invalid_completion_window",
    )
    for name in ("../../escape.jsonl", "a/b.jsonl", "..", "a\\b.jsonl"):
        refused(lambda: upload(client, [request_line("a")], name=name), "invalid_file_name")

    # path-like ids, sent raw (the client itself refuses dot segments)
    for path in ("/v1/files/..%2F..%2Fqueue.db", "/v1/files/..%2Fbatches/content",
                 "/v1/files/file-..", "/v1/batches/..%2F..%2Fjobs", "/v1/batches/batch_..",
                 "/v1/files/%2Fetc%2Fpasswd/content"):  # fmt: skip
        answer = httpx.get(server.url + path, headers={"Authorization": "Bearer unused"})
        assert answer.status_code == 404, (path, answer.text)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    (home / "sentinel").write_text("kept")  # what ../../sentinel from the files folder names
    answer = httpx.delete(server.url + "/v1/files/..%2F..%2Fsentinel")
    assert answer.status_code == 404 and (home / "sentinel").read_text() == "kept"
    answer = httpx.post(server.url + "/v1/batches", content=b"{not json")
    assert answer.status_code == 400 and answer.json()["error"]["message"]
    assert (stored_files(home), job_records(home)) == before


def test_api_key_is_required_when_set(servers):
    server = servers("--api-key", "s3cret", api_key="s3cret")
    assert server.client.models.list().data  # the right key
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for path in ("/v1/models", "/v1/files", "/", "/status.json"):
            answer = httpx.get(server.url + path, headers=headers)
            assert answer.status_code == 401, path
            assert answer.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.files.list()


def test_binding_beyond_loopback_needs_an_api_key(home):
    out = cli("serve", "--host", "0.0.0.0", "--port", "0", home=home)
    assert out.returncode == 2, out.stderr
    assert "--api-key" in out.stderr and "Traceback" not in out.stderr
    assert not (home / "serve").exists()


def test_a_port_in_use_is_refused_naming_it(home):  # noqa: F811
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = cli("serve", "--port", port, home=home)
    assert out.returncode == 2 and "--port" in out.stderr and "Traceback" not in out.stderr
    out = cli("serve", "--port", "http", home=home)
    assert out.returncode == 2 and "--port" in out.stderr


def test_batch_completes_after_its_worker_is_killed(servers, workers, home, monkeypatch):
    """kill -9 of the worker mid-batch; a new worker resumes it: every custom_id once."""
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.3")
    monkeypatch.setenv("FAKE_ENGINE_BATCH", "2")
    client = servers("--chunk-size", "4").client
    ids = [f"k-{i:02d}" for i in range(24)]
    source = upload(client, [request_line(i, f"prompt {i}") for i in ids])
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    first = workers()
    wait_for(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 3,
        timeout=120,
        what="a few requests done",
    )
    first.kill9()
    assert client.batches.retrieve(batch.id).status == "in_progress"
    workers()
    batch, seen = wait_batch(client, batch.id)
    assert batch.status == "completed", seen
    got = [ln["custom_id"] for ln in lines_of(client, batch.output_file_id)]
    got += [ln["custom_id"] for ln in lines_of(client, batch.error_file_id)]
    assert collections.Counter(got) == collections.Counter(ids)
    assert batch.request_counts.completed == 24


def test_status_page_and_its_json(servers):
    server = servers("--worker")
    client = server.client
    source = upload(client, [request_line(f"s-{i}") for i in range(3)])
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    batch, _ = wait_batch(client, batch.id)
    figures = httpx.get(server.url + "/status.json").json()
    [job] = figures["jobs"]
    assert job["batch"] == {"id": batch.id, "status": "completed"}
    assert (job["state"], job["done"], job["total"]) == ("completed", 3, 3)
    assert job["tokens_per_s"] > 0 and job["mean_acceptance_drafted"] > 0
    assert sum(job["acceptance_histogram"]) > 0 and not figures["active"]
    page = httpx.get(server.url + "/")
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    assert batch.id in html and job["id"] in html and "<svg" in html and "<rect" in html
    assert 'http-equiv="refresh"' not in html  # nothing runs: no reloading
    json.dumps(figures)
