"""``/v1/chat/completions`` and ``/v1/completions`` on ``dflash-batch serve``, driven by OpenAI's own
client over loopback: answers (whole and streamed) equal the engine's own output for the request;
one sent while a batch job runs is answered while the job is held mid-chunk, and the job still
completes with every row once; a client that goes away cancels its request; bad requests get
OpenAI-shaped errors; the status page counts the traffic. The fake engine (tests/fake_engine.py)
answers in the server's processes; ``test_tiny_pair_*`` runs the real engine on the seeded pair."""

from __future__ import annotations

import json
import os

import pytest

from tests.fake_engine import FakeEngine, words_for
from tests.runner_fixtures import fake_models, home, wait_for  # noqa: F401
from tests.serve_fixtures import (
    CHAT,
    httpx,
    jsonl,
    lines_of,
    openai,
    request_line,
    servers,
    wait_batch,
)  # noqa: F401

MESSAGES = [{"role": "user", "content": "tell me about ducks"}]


def _expected(prompt, max_tokens: int) -> str:
    """What the fake engine answers: its words for the prompt, the budget's worth."""
    return " ".join(words_for(prompt, max_tokens))


def test_chat_answer_whole_and_streamed_with_the_openai_client(servers):
    client = servers().client  # no worker: the server's own loop answers
    answer = client.chat.completions.create(model="whatever", messages=MESSAGES, max_tokens=6)
    assert answer.choices[0].message.content == _expected(MESSAGES, 6)
    assert answer.choices[0].finish_reason == "length"
    assert answer.object == "chat.completion" and answer.model == "SmolLM2-135M-Instruct"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (4, 6)
    stats = answer.model_extra["dflash"][0]  # the documented extension key
    assert stats["cycles"] > 0 and stats["drafted_tokens"] > 0 and stats["tokens_per_cycle"] > 1

    stream = client.chat.completions.create(model="whatever", messages=MESSAGES, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _expected(MESSAGES, 6)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len([c for c in chunks if c.choices]) > 3  # streamed piece by piece, not at once


def test_completions_endpoint_and_n_samples(servers):
    client = servers().client
    answer = client.completions.create(model="m", prompt="once upon a time", max_tokens=5, n=2)
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.text == _expected("once upon a time", 5) for c in answer.choices)
    assert answer.object == "text_completion" and answer.usage.completion_tokens == 10
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="m", prompt="once upon a time", max_tokens=5, stream=True
        )
        if c.choices
    )
    assert streamed == _expected("once upon a time", 5)


def test_interactive_request_is_answered_while_a_batch_job_runs(
    servers, home, tmp_path, monkeypatch
):
    hold = tmp_path / "hold"
    hold.touch()  # the worker's batch steps wait while this exists
    monkeypatch.setenv("FAKE_ENGINE_HOLD", str(hold))
    monkeypatch.setenv("FAKE_ENGINE_BATCH", "2")
    server = servers("--worker", "--chunk-size", "4")
    client = server.client
    lines = [request_line(f"req-{i}", f"prompt number {i}") for i in range(6)]
    source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint=CHAT, completion_window="24h")
    wait_for(lambda: any(p.name.startswith("hold.") for p in tmp_path.iterdir()), timeout=120,
             what="the worker held mid-chunk")  # fmt: skip
    # the job cannot move; the interactive request is answered by the same engine meanwhile
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, timeout=60)
    assert answer.choices[0].message.content == _expected(MESSAGES, 4)
    assert client.batches.retrieve(batch.id).request_counts.completed < 6
    status = httpx.get(f"{server.url}/status.json").json()
    assert status["interactive"]["requests"] == 1
    assert (
        server.log().count("loading the served model") == 1
    )  # one engine for the job and the request
    hold.unlink()
    batch, _ = wait_batch(client, batch.id)
    assert batch.status == "completed", server.log()
    output = lines_of(client, batch.output_file_id)
    assert sorted(ln["custom_id"] for ln in output) == [f"req-{i}" for i in range(6)]  # each once


def test_bad_requests_get_openai_shaped_errors(servers):
    server = servers()
    client = server.client
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens" and "max_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt=[1, 2, 3])
    for raw in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{server.url}/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "stream": "yes"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    # an empty prompt is the engine's refusal, in the same shape
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "   "}], max_tokens=3
        )


def test_the_api_key_rule_covers_interactive_requests(servers):
    server = servers("--api-key", "sekret", api_key="sekret")
    assert server.client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2).choices
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)


def test_a_stream_the_client_leaves_is_cancelled(servers, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0")
    server = servers()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": MESSAGES, "max_tokens": 3, "stream": True}) as r:  # fmt: skip
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the server saw the request, and the next one is answered: nothing is stuck
    answer = server.client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    assert answer.choices[0].message.content == _expected(MESSAGES, 3)
    status = httpx.get(f"{server.url}/status.json").json()["interactive"]
    assert status["requests"] == 2 and status["waiting"] == 0
    page = httpx.get(server.url).text
    assert 'id="interactive"' in page and 'data-name="requests">2<' in page


def test_the_fake_engine_streams_what_it_completes():
    """The fake engine's interactive answers are its completions, piece by piece (the serve tests
    above lean on it)."""
    from dflash_batch.inbox import Inbox, Ticket
    from dflash_batch.request import Options, Request

    pieces, inbox = [], Inbox()
    ticket = Ticket(
        Request("t", "a prompt here", Options(max_tokens=5)), on_piece=lambda k, p: pieces.append(p)
    )
    inbox.put(ticket)
    assert list(FakeEngine().generate_requests([], inbox=inbox)) == []
    assert (
        "".join(p.text for p in pieces) == ticket.outcomes[0].text == _expected("a prompt here", 5)
    )


@pytest.mark.skipif(
    os.environ.get("DFLASH_BATCH_ENGINE") is not None, reason="needs the real engine"
)
def test_tiny_pair_answers_equal_the_engines_own_output(tiny_pair, home, tmp_path):
    """The real engine behind the server: greedy answers (whole and streamed) are token for token
    what ``Engine.generate`` gives for the same prompt."""
    from dflash_batch.engine import load_engine

    from tests.serve_fixtures import Server

    target, draft = map(str, tiny_pair)
    server = Server(home, tmp_path / "serve.log", "--target", target, "--draft", draft)
    try:
        engine = load_engine(target, draft)
        want = engine.generate("The sea is", max_tokens=12, chat_template=False).text
        client = server.client
        whole = client.completions.create(model="m", prompt="The sea is", max_tokens=12)
        assert whole.choices[0].text == want
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="m", prompt="The sea is", max_tokens=12, stream=True
            )
            if c.choices
        )
        assert streamed == want
        # the drafter is attached (whether it drafts is the timed width policy's choice: not
        # asserted)
        assert whole.model_extra["dflash"][0]["block_size"] > 1
    finally:
        server.close()
    json.dumps(whole.model_dump())  # plain JSON all through


def test_limits_queue_length_and_max_tokens_cap(tmp_path):
    """A full inbox answers 429 in OpenAI's shape; ``--max-tokens-cap`` bounds what a request
    asks for (in process, over Starlette's test client)."""
    from starlette.testclient import TestClient

    from dflash_batch.inbox import Inbox
    from dflash_batch.server.app import create_app, served_spec
    from dflash_batch.server.resident import Resident

    def app(limit, **overrides):
        resident = Resident(
            lambda **model: FakeEngine(), served_spec(overrides).model, inbox=Inbox(limit)
        )
        return TestClient(create_app(tmp_path, submit=None, overrides=overrides, resident=resident))

    r = app(0).post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    r = app(8, max_tokens_cap=3).post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 50}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == _expected(MESSAGES, 3)
    assert r.json()["usage"]["completion_tokens"] == 3


def test_the_served_model_is_named_as_a_job_records_it(tmp_path):
    """``serve --draft none`` serves plain decoding (no drafter named 'none' is looked for), and a
    local target is its absolute path: the in-process worker's jobs of the same flags share the
    engine."""
    from dflash_batch.server.app import served_spec

    assert served_spec({"draft": "none"}).model["draft"] is None
    assert served_spec({"target": str(tmp_path)}).model["target"] == str(tmp_path.resolve())
    assert served_spec({}).model["draft"] == "auto"
