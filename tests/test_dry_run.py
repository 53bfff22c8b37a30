"""`run --dry-run` and `submit --dry-run`: the input read and counted, the settings and output
folder printed, and nothing else: no model loaded, no job record, no queue entry, no folder."""

from __future__ import annotations

import json

import pytest

from dflash_batch import api, cli
from tests.runner_fixtures import home, write_jsonl  # noqa: F401  (fixtures)


def refuse_to_load(**model):
    raise AssertionError(f"a dry run loaded a model: {model}")


@pytest.fixture
def no_model(monkeypatch):
    """Any engine load, through the named factory or the default one, fails the test."""
    monkeypatch.setenv(api.ENGINE_ENV, "tests.test_dry_run:refuse_to_load")
    monkeypatch.setattr(api, "load_model", refuse_to_load)


@pytest.fixture
def rows(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "one"}, {"id": "b", "prompt": ""}, {"id": "c", "messages": [{"role": "user", "content": "hi"}]},
    ])  # fmt: skip


def written(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_dry_run_counts_rows_and_creates_nothing(command, rows, home, no_model, capsys):  # noqa: F811
    code = cli.main([command, str(rows), "--dry-run", "--max-tokens", "7", "--name", "dry"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_ROWS_FAILED  # the empty prompt is an error row, as in a real run
    assert f"input: {rows}: 3 rows, 1 of them error rows" in out
    assert f"output: {home / 'results' / 'dry'} (0 rows there already)" in out
    assert (
        "  max_tokens: 7" in out and "  name: dry" in out and "model: SmolLM2-135M-Instruct" in out
    )
    assert written(home) == []  # no job record, no queue, no output folder
    assert api.jobs(home) == []


def test_a_dry_run_as_json_gives_the_plan(tmp_path, home, no_model, capsys):  # noqa: F811
    src = write_jsonl(tmp_path / "ok.jsonl", [{"id": "a", "prompt": "one"}])
    assert (
        cli.main(["submit", str(src), "--dry-run", "--json", "--temperature", "0.5"]) == cli.EXIT_OK
    )
    plan = json.loads(capsys.readouterr().out)
    assert (plan["rows"], plan["errors"], plan["done"]) == (1, 0, 0)
    assert plan["settings"]["temperature"] == 0.5 and plan["settings"]["input"] == str(src)
    assert written(home) == []


def test_a_dry_run_refuses_what_the_job_would_refuse(tmp_path, home, no_model, capsys):  # noqa: F811
    assert cli.main(["run", str(tmp_path / "missing.jsonl"), "--dry-run"]) == cli.EXIT_REFUSED
    src = write_jsonl(tmp_path / "ok.jsonl", [{"id": "a", "prompt": "one"}])
    assert cli.main(["run", str(src), "--dry-run", "--top-p", "1.5"]) == cli.EXIT_REFUSED
    assert written(home) == []


def test_a_dry_run_counts_the_rows_already_done(tmp_path, home, monkeypatch, capsys):  # noqa: F811
    """After a real run, the dry run of the same job sees its rows; of another config, the
    refusal the run would get."""
    from tests.fake_engine import FakeEngine

    src = write_jsonl(
        tmp_path / "ok.jsonl", [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}]
    )
    api.run(src, engine=FakeEngine(), max_tokens=3)
    monkeypatch.setattr(api, "load_model", refuse_to_load)
    assert cli.main(["run", str(src), "--dry-run", "--max-tokens", "3"]) == cli.EXIT_OK
    assert "(2 rows there already)" in capsys.readouterr().out
    assert cli.main(["run", str(src), "--dry-run", "--max-tokens", "4"]) == cli.EXIT_REFUSED
    assert "--force" in capsys.readouterr().err
    assert len(api.jobs(home)) == 1  # only the real run's
