"""Input readers and job specs: every accepted format, every bad input and its message."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_batch.runner.items import Fields, InputError, count_rows, read_items
from dflash_batch.runner.spec import JobSpec, SpecError, cron_fields, load_spec
from tests.runner_fixtures import write_jsonl


def items(path, **fields):
    return list(read_items(path, fields=Fields(**fields)))


def test_simple_rows_prompt_messages_and_options(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "Hello", "max_tokens": 5, "temperature": 0.5, "stop": "\n", "system": "Be brief.",
         "metadata": {"k": 1}},
        {"custom_id": "b", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": 7, "prompt": "seven"},
    ])  # fmt: skip
    a, b, c = items(path)
    assert (a.id, a.prompt, a.where, a.index) == ("a", "Hello", "line 1", 0)
    assert a.options == {"max_tokens": 5, "temperature": 0.5, "stop": ["\n"], "system": "Be brief."}
    assert a.metadata == {"k": 1} and a.error is None
    assert b.id == "b" and b.prompt == [{"role": "user", "content": "Hi"}]
    assert c.id == "7"


def test_openai_batch_request_format(tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                  "max_tokens": 9, "temperature": 0, "stop": ["END"]}},
        {"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "P", "max_completion_tokens": 4}},
        {"custom_id": "r3", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ])  # fmt: skip
    r1, r2, r3 = items(path)
    assert r1.prompt[1] == {"role": "user", "content": "U"} and r1.options == {
        "max_tokens": 9,
        "temperature": 0.0,
        "stop": ["END"],
    }
    assert r1.metadata["model"] == "m"
    # a /v1/completions prompt is raw text, as OpenAI's
    assert r2.prompt == "P" and r2.options == {"max_tokens": 4, "chat_template": False}
    assert r3.error.startswith("line 3: url '/v1/embeddings' is not supported")


def test_derived_ids_are_stable_and_unique(tmp_path):
    rows = [{"prompt": "same"}, {"prompt": "same"}, {"prompt": "other"}]
    first = [i.id for i in items(write_jsonl(tmp_path / "a.jsonl", rows))]
    again = [i.id for i in items(write_jsonl(tmp_path / "a.jsonl", rows))]
    appended = [i.id for i in items(write_jsonl(tmp_path / "a.jsonl", rows + [{"prompt": "new"}]))]
    assert first == again == appended[:3] and len(set(first)) == 3
    assert first[0].startswith("a-000000-")


def test_duplicate_ids_name_both_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"id": "x", "prompt": "1"}, {"id": "y", "prompt": "2"}, {"id": "x", "prompt": "3"}],
    )
    with pytest.raises(InputError, match=r"duplicate id 'x' on line 1 and line 3"):
        items(path)


def test_bad_rows_become_error_items_named_by_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        b'{"id": "ok", "prompt": "fine"}',
        b'{"id": "broken", "prompt": ',  # malformed JSON
        b'{"id": "noprompt"}',  # missing prompt field
        b'{"id": "wrongtype", "prompt": 42}',
        b'{"id": "empty", "prompt": "   "}',
        b'{"id": "bad-utf8", "prompt": "caf\xe9"}',
        b"[1, 2]",
        b'{"id": "badmax", "prompt": "x", "max_tokens": "12"}',
        b'{"id": "badmsg", "messages": [{"role": "user", "content": 5}]}',
        b'{"id": "badrole", "messages": [{"role": "wizard", "content": "x"}]}',
        b'{"id": "badstop", "prompt": "x", "stop": [1]}',
        b'{"id": ["list"], "prompt": "x"}',
        b"",
        b'{"id": "last", "prompt": "also fine"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    got = items(path)
    errors = {i.where: i.error for i in got if i.error}
    assert [i.id for i in got if not i.error] == ["ok", "last"]
    assert len(got) == 13  # the blank line is not a row; nothing else is dropped
    assert "not valid JSON (unexpected end of data at column 28)" in errors["line 2"]
    assert "no 'prompt' or 'messages' field" in errors["line 3"]
    assert "'prompt' must be a string, got int" in errors["line 4"]
    assert "'prompt' is empty" in errors["line 5"]
    assert "not valid UTF-8 (byte 0xe9" in errors["line 6"]
    assert "expected a JSON object, got a list" in errors["line 7"]
    assert "'max_tokens' must be a positive integer, got '12'" in errors["line 8"]
    assert "messages[0].content must be a string" in errors["line 9"]
    assert "messages[0].role must be one of" in errors["line 10"]
    assert "'stop' must be a string or a list" in errors["line 11"]
    assert "'id' must be a string or an integer" in errors["line 12"]
    assert all(e.startswith(w + ": ") for w, e in errors.items())
    assert count_rows(path) == (13, 11)


def test_prompt_template_over_row_fields(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"id": "1", "title": "T", "text": "body"}, {"id": "2", "title": "U"}]
    )
    one, two = items(path, prompt_template="Summarize $title:\n${text}")
    assert one.prompt == "Summarize T:\nbody"
    assert two.error == "line 2: prompt_template needs field 'text', which the row lacks"


def test_parquet_fields_and_wrong_columns(tmp_path):
    table = pa.table({
        "doc": ["d1", "d2", "d3"],
        "question": ["What?", "", "Why?"],
        "chat": [[{"role": "user", "content": "hi"}], None, None],
        "max_tokens": [4, None, 6],
    })  # fmt: skip
    path = tmp_path / "q.parquet"
    pq.write_table(table, path)
    d1, d2, d3 = items(path, id_field="doc", prompt_field="question", messages_field="chat")
    assert (
        d1.id == "d1"
        and d1.prompt == [{"role": "user", "content": "hi"}]
        and d1.options == {"max_tokens": 4}
    )
    assert d2.error == "row 2: 'question' is empty"  # rows count from 1, as JSONL lines do
    assert (
        d3.prompt == "Why?" and d3.where == "row 3" and d3.index == 2
    )  # input_index counts from 0
    with pytest.raises(
        InputError,
        match=r"no prompt column 'prompt' and no messages column 'messages' \(columns: doc, question, chat, max_tokens\)",
    ):
        items(path)
    with pytest.raises(InputError, match=r"id_field 'uid' is not a column"):
        items(path, id_field="uid", prompt_field="question")
    with pytest.raises(InputError, match=r"prompt_template uses 'body', not a column"):
        items(path, prompt_template="$body")


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(InputError, match=r"no such file"):
        items(tmp_path / "missing.jsonl")
    bad = tmp_path / "notparquet.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"not a readable Parquet file"):
        items(bad)
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(InputError, match=r"cannot tell the format"):
        items(odd)
    with pytest.raises(InputError, match=r"not a file"):
        items(tmp_path)


# -- job specs ---------------------------------------------------------------------------------
def write_yaml(path, text):
    path.write_text(text)
    return path


def test_yaml_spec_sections_paths_and_precedence(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "in.jsonl", [{"prompt": "x"}])
    path = write_yaml(
        tmp_path / "job.yaml",
        """
name: demo
input: data/in.jsonl
output_dir: out/{name}
model: {target: ./models/t, draft: auto, dtype: float32}
sampling: {max_tokens: 32, temperature: 0.0, seed: 3, stop: "END"}
system_prompt: Be brief.
chunk_size: 4
schedule: "0 2 * * *"
""",
    )
    spec = load_spec(path)
    assert spec.input == str(tmp_path / "data" / "in.jsonl")
    assert spec.target == str(tmp_path / "models" / "t") and spec.dtype == "float32"
    assert (spec.max_tokens, spec.seed, spec.stop, spec.chunk_size) == (32, 3, ["END"], 4)
    assert spec.resolved_output_dir(tmp_path / "home") == tmp_path / "out" / "demo"
    over = load_spec(path, max_tokens=8, temperature=None, chunk_size=2)
    assert (over.max_tokens, over.temperature, over.chunk_size) == (8, 0.0, 2)
    assert (
        JobSpec().max_tokens == 256 and load_spec(tmp_path / "data" / "in.jsonl").max_tokens == 256
    )
    assert load_spec(path, draft="none").draft is None


def test_config_hash_tracks_model_and_sampling_only(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    base = load_spec(tmp_path / "in.jsonl", target="m")
    assert (
        base.config_hash()
        == load_spec(tmp_path / "in.jsonl", target="m", chunk_size=3, retries=2).config_hash()
    )
    for change in ({"max_tokens": 7}, {"temperature": 0.7}, {"seed": 1}, {"stop": ["x"]}, {"target": "n"},
                   {"draft": "d"}, {"block_size": 4}, {"system_prompt": "s"}, {"target_revision": "abc"}):  # fmt: skip
        assert (
            load_spec(tmp_path / "in.jsonl", **dict({"target": "m"}, **change)).config_hash()
            != base.config_hash()
        ), change


@pytest.mark.parametrize("text, message", [
    ("input: x.jsonl\nmax_token: 3\n", r"unknown key 'max_token'"),
    ("input: x.jsonl\nsampling: {max_tokns: 3}\n", r"unknown key 'sampling.max_tokns' \(did you mean 'max_tokens'\?\)"),
    ("input: x.jsonl\nmodel: {targt: m}\n", r"unknown key 'model.targt'"),
    ("input: x.jsonl\nschedule: '61 2 * * *'\n", r"'schedule' '61 2 \* \* \*': bad minute field '61'"),
    ("input: x.jsonl\nschedule: 'every night'\n", r"'schedule' 'every night' is not a cron expression: need 5 fields"),
    ("input: x.jsonl\nsampling: {max_tokens: 0}\n", r"'max_tokens' must be an integer >= 1, got 0"),
    ("input: x.jsonl\nsampling: {temperature: hot}\n", r"'temperature' must be a number >= 0"),
    ("input: x.jsonl\nchunk_size: 2.5\n", r"'chunk_size' must be an integer >= 1"),
    ("input: x.jsonl\nprompt_template: 'no fields'\n", r"'prompt_template' uses no \$field"),
    ("input: x.jsonl\nprompt_template: 'cost $'\n", r"'prompt_template' is malformed"),
    ("input: x.jsonl\noutput_dir: 'out/{user}'\n", r"'output_dir' may use only"),
    ("input: x.jsonl\nchat_template: maybe\n", r"'chat_template' must be true, false or null"),
    ("name: only-a-name\n", r"'input' is required"),
    ("- a\n- b\n", r"must be a YAML mapping"),
    ("input: [unclosed\n", r"invalid YAML"),
    # non-finite and out-of-range numbers
    ("input: x.jsonl\nsampling: {temperature: .nan}\n", r"'temperature' must be a finite number >= 0, got nan"),
    ("input: x.jsonl\nsampling: {temperature: .inf}\n", r"'temperature' must be a finite number >= 0, got inf"),
    ("input: x.jsonl\nsampling: {temperature: -.inf}\n", r"'temperature' must be a finite number >= 0, got -inf"),
    ("input: x.jsonl\nsampling: {temperature: -0.5}\n", r"'temperature' must be a number >= 0, got -0.5"),
    ("input: x.jsonl\nsampling: {temperature: 1.0e-320}\n", r"'temperature' must be 0 \(greedy\) or at least 1e-05"),
    ("input: x.jsonl\nsampling: {max_tokens: .inf}\n", r"'max_tokens' must be an integer >= 1, got inf"),
    ("input: x.jsonl\nsampling: {max_tokens: .nan}\n", r"'max_tokens' must be an integer >= 1, got nan"),
    ("input: x.jsonl\nsampling: {seed: .nan}\n", r"'seed' must be a non-negative integer, got nan"),
    ("input: x.jsonl\nsampling: {seed: 18446744073709551616}\n", r"'seed' must be at most 2\*\*64 - 1"),
    ("input: x.jsonl\nsampling: {max_tokens_cap: 0}\n", r"'max_tokens_cap' must be an integer >= 1 \(or null: no cap\)"),
    ("input: x.jsonl\nmodel: {block_size: .inf}\n", r"'block_size' must be a non-negative integer, got inf"),
    ("input: x.jsonl\nchunk_size: .nan\n", r"'chunk_size' must be an integer >= 1, got nan"),
])  # fmt: skip
def test_bad_specs_name_the_key(tmp_path, text, message):
    path = write_yaml(tmp_path / "job.yaml", text)
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert str(path) in str(info.value)


def test_validate_checks_a_spec_without_changing_it(tmp_path):
    """``validate`` returns the spec as the job keeps it (paths resolved, ``stop`` a list, a
    control of None off, the temperature a float, a draft of "none" None) and leaves the one
    it was given as it was; a bad value is refused naming its key."""
    from dflash_batch.runner.spec import validate

    spec = JobSpec(
        input="in.jsonl",
        stop="END",
        temperature=1,
        top_k=None,
        draft="none",
        chat_template_kwargs=None,
    )
    before = spec.to_dict()
    checked = validate(spec)
    assert spec.to_dict() == before
    assert checked.input == str((Path.cwd() / "in.jsonl").resolve())
    assert (checked.stop, checked.top_k, checked.draft, checked.chat_template_kwargs) == (
        ["END"],
        0,
        None,
        {},
    )
    assert checked.temperature == 1.0 and isinstance(checked.temperature, float)
    assert validate(checked) == checked  # checking again changes nothing
    with pytest.raises(SpecError, match=r"'retries' must be an integer >= 0"):
        validate(JobSpec(input="in.jsonl", retries=-1))


def test_missing_spec_file_and_unknown_override(tmp_path):
    with pytest.raises(SpecError, match=r"no such file"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(
        SpecError, match=r"unknown option 'max_tokns' \(did you mean 'max_tokens'\?\)"
    ):
        load_spec(tmp_path / "in.jsonl", max_tokns=3)


def test_cron_fields():
    assert cron_fields("0 2 * * *") == {
        "minute": "0",
        "hour": "2",
        "day": "*",
        "month": "*",
        "day_of_week": "*",
    }
    assert cron_fields("@daily")["hour"] == "0"
    assert cron_fields("*/15 1-5 * * 1,3")["minute"] == "*/15"
    with pytest.raises(ValueError, match="bad hour field '25'"):
        cron_fields("0 25 * * *")
    json.dumps(cron_fields("@hourly"))


def test_shipped_jobs_and_examples_are_valid():
    from tests.runner_fixtures import REPO

    for path in sorted((REPO / "jobs").glob("*.yaml")):
        spec = load_spec(path)
        got = list(read_items(spec.input, spec.input_format, spec.fields))
        assert got and not [i.error for i in got if i.error], path
    assert load_spec(REPO / "jobs" / "nightly-summaries.yaml").schedule == "0 2 * * *"
    for name in ("prompts.jsonl", "openai_batch.jsonl", "articles.parquet"):
        fields = (
            Fields(id_field="doc_id", prompt_field="text")
            if name.endswith(".parquet")
            else Fields()
        )
        got = list(read_items(REPO / "examples" / name, fields=fields))
        assert len(got) >= 3 and not [i.error for i in got if i.error], name


def test_runner_api_and_cli_import_no_mlx():
    import subprocess
    import sys

    code = (
        "import sys, dflash_batch.runner, dflash_batch.runner.queue, dflash_batch.runner.worker, dflash_batch.runner.cron, dflash_batch.api, dflash_batch.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm') or m.startswith('dflash_batch.engine')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_reading_a_range_from_a_cursor_matches_a_full_pass(tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"p{i}"} if i % 7 else "{broken" for i in range(50)]
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    with open(path, "a") as f:
        f.write("\n\n" + json.dumps({"id": "tail", "prompt": "t"}) + "\n")
    full = items(path)
    for start in (0, 13, 48, 50):
        part = list(read_items(path, start=start, stop=start + 5, cursor=full[start].cursor))
        assert [(i.id, i.where, i.index, i.error) for i in part] == [
            (i.id, i.where, i.index, i.error) for i in full[start : start + 5]
        ]
    table = pa.table({"id": [f"q{i}" for i in range(40)], "prompt": [f"x{i}" for i in range(40)]})
    pq.write_table(table, tmp_path / "g.parquet", row_group_size=8)
    pfull = items(tmp_path / "g.parquet")
    got = list(read_items(tmp_path / "g.parquet", start=19, stop=27))
    assert [(i.id, i.where) for i in got] == [(i.id, i.where) for i in pfull[19:27]]


# -- numbers must be finite (and usable by the engine) -------------------------------------------


def test_non_finite_numbers_as_overrides(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(SpecError, match=r"'temperature' must be a finite number >= 0"):
            load_spec(src, temperature=value)
    assert (
        load_spec(src, temperature=0).temperature == 0.0
        and load_spec(src, temperature=1e-5).temperature == 1e-5
    )
    assert load_spec(src, seed=2**64 - 1).seed == 2**64 - 1


def test_non_finite_numbers_in_rows_are_error_rows_naming_the_field(tmp_path):
    table = pa.table({"id": ["nan", "inf", "ninf", "tiny", "fine"],
                      "prompt": ["a", "b", "c", "d", "e"],
                      "temperature": [float("nan"), float("inf"), -float("inf"), 1e-320, 0.7]})  # fmt: skip
    pq.write_table(table, tmp_path / "t.parquet")
    got = {i.id: i for i in items(tmp_path / "t.parquet")}
    assert got["nan"].error == "row 1: 'temperature' must be a finite number >= 0, got nan"
    assert got["inf"].error == "row 2: 'temperature' must be a finite number >= 0, got inf"
    assert got["ninf"].error == "row 3: 'temperature' must be a finite number >= 0, got -inf"
    assert (
        got["tiny"].error == "row 4: 'temperature' must be 0 (greedy) or at least 1e-05, got 1e-320"
    )
    assert got["fine"].error is None and got["fine"].options == {"temperature": 0.7}
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "prompt": "x", "temperature": 1e999}\n'
                    '{"id": "b", "prompt": "x", "temperature": NaN}\n'
                    '{"custom_id": "c", "body": {"prompt": "x", "temperature": 5e-324}}\n')  # fmt: skip
    a, b, c = items(path)
    assert a.error.startswith("line 1: not valid JSON") and b.error.startswith(
        "line 2: not valid JSON"
    )
    assert c.error == "line 3: 'body.temperature' must be 0 (greedy) or at least 1e-05, got 5e-324"
