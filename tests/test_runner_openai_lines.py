"""OpenAI Batch lines: a /v1/completions line is a raw prompt answered as a text completion,
and every field of a line of the wrong type is that line's error row, naming the field."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

import dflash_batch
from dflash_batch.runner.export import text_logprobs
from dflash_batch.runner.items import read_items
from tests.runner_fixtures import (  # noqa: F401
    cli,
    engine,
    home,
    real_engine,
    tiny_models,
    write_jsonl,
)

URL = "/v1/completions"
MSGS = [{"role": "user", "content": "Say hi."}]
COMPLETION = {"custom_id": "text", "method": "POST", "url": URL,
              "body": {"prompt": "Say hi.", "max_tokens": 3}}  # fmt: skip
CHAT = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": MSGS, "max_tokens": 3}}  # fmt: skip


def exported_lines(text: str) -> dict:
    return {x["custom_id"]: x for x in map(json.loads, text.splitlines())}


def test_completions_line_reaches_the_engine_raw_and_exports_as_text(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "batch.jsonl", [COMPLETION, CHAT])
    out_dir = tmp_path / "out"
    job = dflash_batch.run(src, engine=engine, export_openai=True, output_dir=str(out_dir))
    sent = {r.id: r for r in engine.requests}
    assert sent["text"].prompt == "Say hi."
    assert sent["text"].options.as_kwargs()["chat_template"] is False  # the engine's keyword
    assert sent["chat"].options.chat_template is None  # the job's default: the tokenizer's
    exported = (out_dir / "_openai_output.jsonl").read_text()
    printed = cli("results", job.id, "--format", "openai", home=home, check=True).stdout
    for text in (exported, printed):
        lines = exported_lines(text)
        body = lines["text"]["response"]["body"]
        assert body["object"] == "text_completion" and body["id"] == "cmpl-text"
        [choice] = body["choices"]
        assert isinstance(choice["text"], str) and choice["text"] and "message" not in choice
        assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
        chat = lines["chat"]["response"]["body"]
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"


def test_completions_line_keeps_its_shape_under_user_metadata(tmp_path, home, engine):
    line = dict(COMPLETION, metadata={"url": "/v1/chat/completions", "k": 1})
    src = write_jsonl(tmp_path / "batch.jsonl", [line])
    dflash_batch.run(src, engine=engine, export_openai=True, output_dir=str(tmp_path / "out"))
    lines = exported_lines((tmp_path / "out" / "_openai_output.jsonl").read_text())
    assert lines["text"]["response"]["body"]["object"] == "text_completion"


def test_completions_logprobs_is_a_count_of_alternatives(tmp_path):
    lines = [dict(COMPLETION, body={"prompt": "x", "logprobs": 2}),
             dict(COMPLETION, custom_id="zero", body={"prompt": "x", "logprobs": 0}),
             dict(COMPLETION, custom_id="many", body={"prompt": "x", "logprobs": 99}),
             dict(CHAT, body={"messages": MSGS, "logprobs": 2})]  # fmt: skip
    two, zero, many, chat = read_items(write_jsonl(tmp_path / "in.jsonl", lines))
    assert (two.options["logprobs"], two.options["top_logprobs"]) == (True, 2)
    assert (zero.options["logprobs"], zero.options["top_logprobs"]) == (True, 0)
    assert many.error == "line 3: 'body.logprobs' must be an integer from 0 to 20, got 99"
    assert chat.error == "line 4: 'body.logprobs' must be true or false, got 2"  # chat's: a boolean


def test_completions_logprobs_in_the_completions_shape():
    entries = [{"token": "Hi", "logprob": -0.5, "top_logprobs": [{"token": "Hi", "logprob": -0.5}]},
               {"token": " there", "logprob": -1.0, "top_logprobs": []}]  # fmt: skip
    assert text_logprobs(entries) == {
        "tokens": ["Hi", " there"], "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"Hi": -0.5}, {}], "text_offset": [0, 2],
    }  # fmt: skip


def test_completions_prompt_is_raw_for_the_real_engine(tmp_path, home, real_engine):
    text = dict(COMPLETION, body=dict(COMPLETION["body"], logprobs=1))
    src = write_jsonl(tmp_path / "batch.jsonl", [text, CHAT])
    out_dir = tmp_path / "out"
    dflash_batch.run(src, engine=real_engine, output_dir=str(out_dir), export_openai=True)
    rows = pd.read_parquet(out_dir).set_index("id")
    raw = len(real_engine.tokenizer.encode("Say hi."))
    assert (rows["status"] == "ok").all()
    assert rows.loc["text", "prompt_tokens"] == raw < rows.loc["chat", "prompt_tokens"]
    lines = exported_lines((out_dir / "_openai_output.jsonl").read_text())
    [choice] = lines["text"]["response"]["body"]["choices"]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["token_logprobs"]) == 3
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])


def text_part(text):
    return {"body": {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}}


def content(parts):
    return {"body": {"messages": [{"role": "user", "content": parts}]}}


CASES = [
    ({"url": [URL], "body": {"prompt": "x"}}, "'url' must be a string, got a list"),
    ({"url": {"a": 1}, "body": {"prompt": "x"}}, "'url' must be a string, got an object"),
    ({"method": ["POST"], "body": {"prompt": "x"}}, "'method' must be 'POST', got ['POST']"),
    ({"method": "GET", "body": {"prompt": "x"}}, "'method' must be 'POST', got 'GET'"),
    ({"url": URL, "body": "Say hi."}, "'body' must be an object, got a string"),
    ({"method": "POST", "body": None}, "'body' must be an object, got null"),
    (
        {"body": {"messages": {"role": "user"}}},
        "'body.messages' must be a non-empty list of messages, got an object",
    ),
    (
        {"body": {"messages": ["Hi"]}},
        "body.messages[0] must be an object with 'role' and 'content', got a string",
    ),
    (text_part(5), "body.messages[0].content[0].text must be a string, got int"),
    (
        content([{"type": "image_url", "image_url": {"url": "u"}}]),
        "body.messages[0].content[0].type must be 'text'",
    ),
    (content(["Hi"]), "body.messages[0].content[0] must be an object"),
    (
        {"body": {"messages": [{"role": ["user"], "content": "Hi"}]}},
        "body.messages[0].role must be one of",
    ),
    (
        {"custom_id": ["a"], "body": {"messages": MSGS}},
        "'custom_id' must be a string or an integer, got a list",
    ),
    (
        {"custom_id": True, "body": {"messages": MSGS}},
        "'custom_id' must be a string or an integer, got a boolean",
    ),
    ({"url": URL, "body": {"prompt": ["a", "b"]}}, "'body.prompt' must be a string, got a list"),
    ({"url": URL, "body": {"messages": MSGS}}, "'body.messages' is for /v1/chat/completions"),
    ({"body": {"messages": MSGS, "model": ["m"]}}, "'body.model' must be a string, got a list"),
    ({"body": {"messages": MSGS}, "metadata": ["m"]}, "'metadata' must be an object, got a list"),
    (
        {"body": {"messages": MSGS, "max_completion_tokens": "9"}},
        "'body.max_completion_tokens' must be a positive integer",
    ),
]


def test_openai_line_fields_of_the_wrong_type_are_error_rows_naming_them(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [line for line, _ in CASES])
    errors = [item.error for item in read_items(path)]
    for n, ((line, says), error) in enumerate(zip(CASES, errors), start=1):
        assert error and error.startswith(f"line {n}: ") and says in error, (line, error)


def test_a_plain_row_with_a_field_named_body_stays_a_plain_row(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Summarize.", "body": "text"}])
    [item] = read_items(path)
    assert item.error is None and item.prompt == "Summarize."


def test_bad_openai_lines_become_error_rows_and_the_job_completes(tmp_path, home, engine):
    lines = [CHAT, {"custom_id": "u", "url": ["x"], "body": {"prompt": "x"}},
             dict(text_part(1), custom_id="t")]  # fmt: skip
    src = write_jsonl(tmp_path / "b.jsonl", lines)
    status = dflash_batch.run(src, engine=engine, output_dir=str(tmp_path / "out")).status()
    assert (status["state"], status["ok"], status["failed"]) == ("completed", 1, 2)


def test_openai_rows_in_parquet_take_null_fields_as_absent(tmp_path, home, engine):
    # Parquet gives every row each struct field of the column: a null one is not given
    rows = [COMPLETION, dict(CHAT, body={"messages": MSGS, "max_completion_tokens": 2}),
            {"custom_id": "plain", "body": {"prompt": "Hello"}}]  # fmt: skip
    path = tmp_path / "batch.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    text, chat, plain = read_items(path)
    assert [text.error, chat.error, plain.error] == [None, None, None]
    assert text.prompt == "Say hi." and text.options == {"max_tokens": 3, "chat_template": False}
    assert chat.prompt == MSGS and chat.options == {"max_tokens": 2}
    assert plain.prompt == "Hello" and plain.metadata == {"url": "/v1/chat/completions"}
    dflash_batch.run(path, engine=engine, export_openai=True, output_dir=str(tmp_path / "out"))
    lines = exported_lines((tmp_path / "out" / "_openai_output.jsonl").read_text())
    kinds = {k: line["response"]["body"]["object"] for k, line in lines.items()}
    assert kinds == {
        "text": "text_completion",
        "chat": "chat.completion",
        "plain": "chat.completion",
    }
