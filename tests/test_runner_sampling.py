"""Sampling controls, logprobs and structured output through the runner: job specs (YAML layout
and overrides), the CLI flags, row and OpenAI body fields; each row as the engine generates it
alone with the same options; the Parquet ``logprobs`` column and OpenAI ``choices[].logprobs``;
bad values refused naming the key or the row's field, before any generation."""

from __future__ import annotations

import json

import jsonschema
import pandas as pd
import pytest

import dflash_batch
from dflash_batch.runner.spec import SpecError, load_spec
from tests.runner_fixtures import cli, engine, home, real_engine, tiny_models, write_jsonl  # noqa: F401

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
# fmt: off
ROWS = [
    {"id": "plain", "prompt": "Tell me a story."},
    {"id": "controls", "prompt": "Name a colour.", "top_k": 3, "repetition_penalty": 1.4, "temperature": 0.9},
    {"custom_id": "json", "body": {"messages": [{"role": "user", "content": "Give a record."}],
                                   "response_format": JSON_FORMAT, "logprobs": True, "top_logprobs": 2}},
    {"custom_id": "bad", "body": {"messages": [{"role": "user", "content": "Hi"}],
                                  "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}}},
]
# fmt: on


def test_rows_get_their_controls_logprobs_and_constraints(tmp_path, home, real_engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    job = dflash_batch.run(src, engine=real_engine, seed=5, max_tokens=40, top_p=0.9, presence_penalty=0.5,
                           export_openai=True, output_dir=str(tmp_path / "out"))  # fmt: skip
    df = job.to_pandas().set_index("id")
    assert df.loc["bad", "status"] == "error"
    assert "'body.response_format' cannot be compiled" in df.loc["bad", "error"]
    # each row as the engine makes it alone: the row's own options over the job's
    job_kw = dict(max_tokens=40, seed=5, top_p=0.9, presence_penalty=0.5)
    expected = {
        "plain": real_engine.generate("Tell me a story.", **job_kw),
        "controls": real_engine.generate(
            "Name a colour.", **dict(job_kw, top_k=3, repetition_penalty=1.4, temperature=0.9)
        ),
        "json": real_engine.generate(
            [{"role": "user", "content": "Give a record."}],
            response_format=JSON_FORMAT,
            logprobs=True,
            top_logprobs=2,
            **job_kw,
        ),
    }
    for key, c in expected.items():
        assert df.loc[key, "output"] == c.text, key
    jsonschema.validate(json.loads(df.loc["json", "output"]), SCHEMA)
    # the Parquet column: per token, raw logprob and alternatives; null where not asked
    column = pd.read_parquet(tmp_path / "out").set_index("id")["logprobs"]
    assert column["plain"] is None
    entries = list(column["json"])
    assert [e["token_id"] for e in entries] == expected["json"].token_ids
    # fp32 logprobs of passes of other shapes (the batch's widths against the row's alone, chosen from
    # timed costs) differ in their last bits: 3.1e-6 on -3.05 seen, over approx's default 1e-6 relative
    assert [e["logprob"] for e in entries] == pytest.approx(
        [e["logprob"] for e in expected["json"].logprobs], abs=1e-5
    )
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    # OpenAI output: choices[].logprobs.content in OpenAI's shape
    lines = {
        x["custom_id"]: x
        for x in map(
            json.loads, (tmp_path / "out" / "_openai_output.jsonl").read_text().splitlines()
        )
    }
    choice = lines["json"]["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [e["token"] for e in expected["json"].logprobs]
    assert (
        set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
        and len(content[0]["top_logprobs"]) == 2
    )
    assert lines["plain"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert lines["bad"]["error"]["code"] == "generation_error"


def test_job_values_are_checked_and_hashed(tmp_path):
    src = str(write_jsonl(tmp_path / "x.jsonl", ROWS[:1]))
    base = load_spec({"input": src})
    assert (
        base.config_hash()
        == load_spec({"input": src, "sampling": {"top_p": 1.0, "logprobs": False}}).config_hash()
    )
    spec = load_spec(
        {"input": src, "sampling": {"top_k": 4, "response_format": JSON_FORMAT, "logprobs": True}}
    )
    assert (spec.top_k, spec.logprobs) == (4, True) and spec.config_hash() != base.config_hash()
    for key, value, says in [
        ("top_p", 0, "'top_p' must be a number in (0, 1]"),
        ("top_k", -1, "'top_k' must be an integer >= 0"),
        ("min_p", 1.5, "'min_p' must be a number in [0, 1)"),
        ("presence_penalty", 3, "'presence_penalty' must be a number in [-2, 2]"),
        ("repetition_penalty", 0, "'repetition_penalty' must be a number > 0"),
        ("top_logprobs", 21, "'top_logprobs' must be an integer from 0 to 20"),
        ("logprobs", "yes", "'logprobs' must be true or false"),
        (
            "response_format",
            {"type": "regex", "regex": "(("},
            "'response_format' cannot be compiled",
        ),
    ]:
        with pytest.raises(SpecError, match=__import__("re").escape(says)):
            load_spec({"input": src, "sampling": {key: value}})


def test_cli_flags(tmp_path, home, tiny_models):
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": "Give a record."}, {"id": "b", "prompt": "Hi", "top_k": "x"}],
    )
    (tmp_path / "fmt.json").write_text(json.dumps(JSON_FORMAT))
    out = tmp_path / "out"
    cli("run", src, "--target", tiny_models["target"], "--draft", tiny_models["draft"], "--max-tokens", "40",
        "--response-format", f"@{tmp_path / 'fmt.json'}", "--logprobs", "--top-logprobs", "3", "--top-k", "5",
        "--temperature", "0.7", "--seed", "1", "--no-progress", "--output-dir", out, home=home)  # fmt: skip
    df = pd.read_parquet(out).set_index("id")
    jsonschema.validate(json.loads(df.loc["a", "output"]), SCHEMA)
    assert len(df.loc["a", "logprobs"]) > 0 and len(df.loc["a", "logprobs"][0]["top_logprobs"]) == 3
    assert (
        df.loc["b", "status"] == "error"
        and "'top_k' must be an integer >= 0" in df.loc["b", "error"]
    )
    bad = cli(
        "run",
        src,
        "--target",
        tiny_models["target"],
        "--top-p",
        "2",
        "--output-dir",
        tmp_path / "o2",
        home=home,
    )
    assert bad.returncode != 0 and "top_p" in bad.stderr
