"""Input and arguments as a new user meets them: a JSON document instead of JSON Lines is
refused before any work, a line that is not JSON says so, ``--home`` goes before or after the
command, and a prompt over the tokenizer's own limit gets the engine's error alone."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from dflash_batch.cli import build_parser
from dflash_batch.completion import PromptTooLongError
from dflash_batch.runner.items import InputError, read_items
from tests.runner_fixtures import cli, fake_models, home, tiny_models, write_jsonl  # noqa: F401

ROWS = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Say bye."}]


@pytest.mark.parametrize("text, shape", [
    (json.dumps(ROWS), "opens a JSON array"),
    (json.dumps(ROWS, indent=2), "opens a JSON array"),
    ("\n" + json.dumps(ROWS[0], indent=2), "opens a JSON object spread over several lines"),
])  # fmt: skip
def test_a_json_document_is_refused_not_read_as_error_rows(tmp_path, text, shape):
    path = tmp_path / "rows.json"
    path.write_text(text + "\n")
    says = f"rows.json: line [12] {shape}; the input must be JSON Lines"
    with pytest.raises(InputError, match=says):
        list(read_items(path))


def test_run_of_a_json_array_exits_2_before_work_and_leaves_no_job(tmp_path, home, fake_models):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS) + "\n")
    proc = cli("run", path, "--target", fake_models["target"], home=home)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "line 1 opens a JSON array; the input must be JSON Lines" in proc.stderr
    assert "jq -c '.[]' rows.json > rows.jsonl" in proc.stderr
    assert not list((home / "jobs").glob("*/job.json"))


def test_a_line_that_is_not_json_says_so(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\nthe cat sat\n{"id": "c", "prompt": "x", }\n')
    a, b, c = read_items(path)
    assert a.error is None
    assert b.error == "line 2: not valid JSON (invalid literal, expected 'true' at column 1)"
    assert c.error.startswith("line 3: not valid JSON (") and "at column 26)" in c.error


COMMANDS = [["submit", "x.jsonl"], ["run", "x.jsonl"], ["worker"], ["status"], ["status", "J"],
            ["cancel", "J"], ["retry", "J"], ["schedules"], ["unschedule", "N"],
            ["results", "J"]]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_home_redis_and_verbose_go_before_or_after_the_command(command):
    parser = build_parser()
    after = parser.parse_args(command + ["--home", "B", "--redis", "redis://r", "-v"])
    assert (after.home, after.redis, after.verbose) == ("B", "redis://r", True)
    before = parser.parse_args(["--home", "A", "-v"] + command)
    assert (before.home, before.redis, before.verbose) == ("A", None, True)
    both = parser.parse_args(["--home", "A"] + command + ["--home", "B"])
    assert both.home == "B"  # the later one, as for any repeated option
    neither = parser.parse_args(command)
    assert (neither.home, neither.redis, neither.verbose) == (None, None, False)


def test_run_with_home_after_the_command_uses_that_home(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    other = tmp_path / "other-home"
    cli("run", src, "--max-tokens", 2, "--target", fake_models["target"], "--home", other,
        home=home, check=True)  # fmt: skip
    assert len(list((other / "jobs").glob("*/job.json"))) == 1
    assert not (home / "jobs").exists()
    out = cli("status", "--home", other, "--json", home=home, check=True).stdout
    assert json.loads(out)[0]["state"] == "completed"


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_long_prompt_gets_the_clean_error_without_a_tokenizer_warning(tmp_path, tiny_models):
    from dflash_batch.engine import load_engine

    target = Path(shutil.copytree(tiny_models["target"], tmp_path / "target"))
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps(dict(config, model_max_length=16)))
    engine = load_engine(str(target), None, max_context=64)
    records = Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with pytest.raises(PromptTooLongError, match="context is 64"):
            engine.request("word " * 200)
        with pytest.raises(PromptTooLongError, match="context is 64"):
            engine.request([{"role": "user", "content": "word " * 200}])
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not [m for m in records.messages if "sequence length is longer" in m]
