"""What `run`, `status` and the API print: counts name their unit (items, or result rows, one
per sample), each tok/s figure names which rate it is, `-q` silences INFO logs, and log lines
never start inside the progress bar. Fake engine: no MLX."""

from __future__ import annotations

import re

import dflash_batch
from tests.runner_fixtures import cli, fake_models, home, write_jsonl  # noqa: F401

# four items, one with two samples, and one that fails: 5 items, 6 result rows
PROMPTS = [{"id": "a", "prompt": "Say a", "n": 2}]
PROMPTS += [{"id": f"p{i}", "prompt": f"Say {i}"} for i in range(3)]
ROWS = PROMPTS + [{"id": "bad", "prompt": ""}]


def fake_flags(fake_models, *extra):
    models = ["--target", fake_models["target"], "--draft", fake_models["draft"]]
    return [*models, "--max-tokens", "5", *map(str, extra)]


def test_status_and_the_run_summary_count_items_and_rows_apart(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    ran = cli("run", src, *fake_flags(fake_models, "-q"), home=home)
    assert ran.returncode == 5, ran.stderr
    assert "5/5 items done; 6 rows: 5 ok, 1 failed" in ran.stdout
    assert "1 of 6 rows failed" in ran.stderr  # rows, not "of 5" items
    job_id = ran.stdout.split()[0]
    status = cli("status", job_id, home=home, check=True).stdout
    assert "5/5 items done; 6 rows: 5 ok, 1 failed" in status
    assert "decode tok/s (mean per row) " in status
    assert status.count("tok/s") == 1  # no other, unnamed rate
    data = dflash_batch.Job(job_id).status()
    counts = [data[k] for k in ("total", "done", "rows", "ok", "failed")]
    assert counts == [5, 5, 6, 5, 1]
    expected = f"Job('{job_id}', completed: 5/5 items done; 6 rows: 5 ok, 1 failed)"
    assert repr(dflash_batch.Job(job_id)) == expected


def test_resubmit_says_items_and_rows(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    cli("run", src, *fake_flags(fake_models, "-q"), home=home)
    out = cli("submit", src, *fake_flags(fake_models), home=home, check=True)
    assert "all 5 items already done (6 rows: 5 ok, 1 failed): nothing queued" in out.stderr


def test_quiet_run_prints_no_info_lines(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    quiet = cli("run", src, *fake_flags(fake_models, "-q"), home=home, check=True)
    assert " INFO " not in quiet.stderr and "items done" in quiet.stdout
    loud = cli("run", src, *fake_flags(fake_models, "-o", tmp_path / "loud"), home=home, check=True)
    assert " INFO " in loud.stderr  # without -q the same run logs: the check above means something


def test_log_lines_start_on_their_own_line_and_the_bar_names_its_rate(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    ran = cli("run", src, *fake_flags(fake_models), home=home, check=True)
    logged = [line for line in ran.stderr.split("\n") if " INFO " in line]
    assert logged
    for line in logged:  # what follows the last carriage return is what a terminal shows
        shown = line.split("\r")[-1]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO ", shown), repr(line)
    bars = [seg for seg in re.split(r"[\r\n]", ran.stderr) if " items " in seg]
    assert re.search(r"[\d.]+ output tok/s \(whole job\)", bars[-1])
