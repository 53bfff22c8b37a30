"""`results JOB --text` and `--columns`: a job's answers read in one command, in input order
(the fake engine finishes rows out of order, as a batch does)."""

from __future__ import annotations

import json

import dflash_batch
from dflash_batch import cli
from tests.fake_engine import FakeEngine, words_for
from tests.runner_fixtures import home, write_jsonl  # noqa: F401  (fixtures)

ROWS = [{"id": f"r{i}", "prompt": f"prompt number {i}"} for i in range(9)] + [
    {"id": "bad", "prompt": ""}
]


def finished_job(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS + [{"id": "two", "prompt": "twice", "n": 2}])
    return dflash_batch.run(src, engine=FakeEngine(batch=4), max_tokens=3)


def test_text_prints_each_answer_in_input_order(tmp_path, home, capsys):  # noqa: F811
    job = finished_job(tmp_path)
    assert cli.main(["results", job.id, "--text"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("--- ")]
    assert heads == [f"--- {r['id']}" for r in ROWS] + ["--- two", "--- two (sample 1)"]
    assert f"--- r3\n{' '.join(words_for('prompt number 3', 3))}\n" in out
    assert "--- bad\nerror: " in out  # an error row says why instead of an answer


def test_columns_prints_those_columns_as_json_lines(tmp_path, home, capsys):  # noqa: F811
    job = finished_job(tmp_path)
    assert cli.main(["results", job.id, "--columns", "id,completion_tokens"]) == cli.EXIT_OK
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS] + ["two", "two"]
    assert all(set(r) == {"id", "completion_tokens"} for r in rows)
    assert rows[0]["completion_tokens"] == 3


def test_an_unknown_column_is_refused_with_the_names(tmp_path, home, capsys):  # noqa: F811
    job = finished_job(tmp_path)
    assert cli.main(["results", job.id, "--columns", "id,answer"]) == cli.EXIT_REFUSED
    err = capsys.readouterr().err
    assert "answer" in err and "output" in err
