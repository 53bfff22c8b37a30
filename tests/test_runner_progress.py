"""Progress of a whole job: `run` and `status --watch` show items done, tokens/s and ETA on
stderr; `-q` silences them. Fake engine: no MLX."""

from __future__ import annotations

import io
import re

import dflash_batch
from dflash_batch.runner.progress import Progress
from tests.runner_fixtures import cli, fake_models, home, wait_for, workers, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt {i}: say something"} for i in range(6)]


def fake_flags(fake_models, *extra):
    return [
        "--target",
        fake_models["target"],
        "--draft",
        fake_models["draft"],
        "--max-tokens",
        "5",
        *map(str, extra),
    ]


def last_bar(stderr: str) -> str:
    """The bar as last drawn (tqdm redraws it with carriage returns)."""
    return [line for line in re.split(r"[\r\n]", stderr) if " items " in line][-1]


def test_progress_counts_items_not_samples_and_tokens_per_second():
    out = io.StringIO()
    bar = Progress(total=3, done=1, desc="job", file=out)
    for sample in range(2):  # item b's two samples: one item
        bar.row({"id": "b", "completion_tokens": 10, "sample_index": sample})
    bar.row({"id": "c", "completion_tokens": 5})
    assert bar.bar.n == 3 and bar.tokens == 25 and bar.rate() > 0
    bar.close()
    text = last_bar(out.getvalue())
    assert "3/3 items" in text and "tok/s" in text and "ETA" in text


def test_run_shows_items_tokens_per_second_and_eta(tmp_path, home, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    ran = cli("run", src, *fake_flags(fake_models), home=home, check=True)
    bar = last_bar(ran.stderr)
    assert "6/6 items" in bar and "ETA" in bar
    assert float(re.search(r"([\d.]+) output tok/s \(whole job\)", bar).group(1)) > 0
    quiet = cli(
        "run",
        src,
        *fake_flags(fake_models, "-q", "--output-dir", tmp_path / "q"),
        home=home,
        check=True,
    )
    assert " items " not in quiet.stderr and "tok/s" not in quiet.stderr
    # a rerun starts the bar at what is already done
    again = cli("run", src, *fake_flags(fake_models), home=home, check=True)
    assert "6/6 items" in last_bar(again.stderr)


def test_status_watch_follows_a_queued_job_to_the_end(
    tmp_path, home, fake_models, workers, monkeypatch
):
    monkeypatch.setenv("FAKE_ENGINE_DELAY", "0.05")
    job = dflash_batch.submit(write_jsonl(tmp_path / "in.jsonl", PROMPTS), target=fake_models["target"],
                              draft=fake_models["draft"], max_tokens=5, chunk_size=2)  # fmt: skip
    refused = cli("status", "--watch", home=home)
    assert refused.returncode == 2 and "give its id" in refused.stderr
    w = workers()
    watched = cli("status", job.id, "--watch", "0.2", home=home, timeout=240)
    assert watched.returncode == 0, watched.stderr
    assert "completed" in watched.stdout and "6/6 items" in last_bar(watched.stderr)
    assert "tok/s" in last_bar(watched.stderr) and "ETA" in last_bar(watched.stderr)
    quiet = cli("status", job.id, "--watch", "-q", home=home, timeout=60)
    assert quiet.returncode == 0 and " items " not in quiet.stderr and "completed" in quiet.stdout
    assert w.stop() == 0
