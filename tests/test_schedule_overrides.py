"""``submit`` of a scheduled YAML applies its command-line flags to the registered schedule (the
jobs a worker's cron submits from it use them), and ``schedules`` shows them."""

from __future__ import annotations

import datetime
import json

import pytest

from dflash_batch import api, cli
from dflash_batch.runner.cron import Cron
from dflash_batch.runner.queue import Queue
from dflash_batch.runner.spec import load_spec
from tests.runner_fixtures import REPO, home  # noqa: F401  (fixture)

NIGHTLY = REPO / "jobs" / "nightly-summaries.yaml"

# Each flag `submit` accepts (besides --now and --json), with the spec field it sets and the
# value the registered schedule must hold. The YAML sets none of these values itself.
FLAGS = [
    (["--name", "renamed"], "name", "renamed"),
    (["-o", "out/{date}"], "output_dir", "CWD/out/{date}"),
    (["--input-format", "parquet"], "input_format", "parquet"),
    (["--id-field", "title"], "id_field", "title"),
    (["--prompt-field", "body"], "prompt_field", "body"),
    (["--messages-field", "chat"], "messages_field", "chat"),
    (["--prompt-template", "Title: $title"], "prompt_template", "Title: $title"),
    (["--system", "Be brief."], "system_prompt", "Be brief."),
    (["--no-chat-template"], "chat_template", False),
    (["--target", "org/model"], "target", "org/model"),
    (["--target-revision", "v2"], "target_revision", "v2"),
    (["--draft", "org/drafter"], "draft", "org/drafter"),
    (["--no-draft"], "draft", None),
    (["--draft-revision", "v3"], "draft_revision", "v3"),
    (["--dtype", "float16"], "dtype", "float16"),
    (["--block-size", "8"], "block_size", 8),
    (["--prefix-cache-mb", "0"], "prefix_cache_mb", 0.0),
    (["--max-tokens", "32"], "max_tokens", 32),
    (["--max-tokens-cap", "16"], "max_tokens_cap", 16),
    (["--temperature", "0.5"], "temperature", 0.5),
    (["--seed", "7"], "seed", 7),
    (["--n", "2"], "n", 2),
    (["--stop", "END", "--stop", "FIN"], "stop", ["END", "FIN"]),
    (["--top-k", "5"], "top_k", 5),
    (["--top-p", "0.9"], "top_p", 0.9),
    (["--min-p", "0.1"], "min_p", 0.1),
    (["--repetition-penalty", "1.1"], "repetition_penalty", 1.1),
    (["--presence-penalty", "0.5"], "presence_penalty", 0.5),
    (["--frequency-penalty", "0.25"], "frequency_penalty", 0.25),
    (["--logprobs"], "logprobs", True),
    (["--top-logprobs", "3"], "top_logprobs", 3),
    (["--response-format", '{"type": "json_object"}'], "response_format", {"type": "json_object"}),
    (["--chunk-size", "4"], "chunk_size", 4),
    (["--batch-size", "2"], "batch_size", 2),
    (["--control", "0.25"], "control", 0.25),
    (["--retries", "5"], "retries", 5),
    (["--export-openai"], "export_openai", True),
    (["--force"], "force", True),
]


def submit_flags():
    """The dests of `submit`'s own options, as its parser defines them."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["submit"]
    return {a.dest for a in sub._actions if a.option_strings and a.dest != "help"}


def test_every_submit_flag_is_covered_here():
    every_command = {"home", "redis", "verbose"}  # where state lives, not what a job is
    assert submit_flags() - {"now", "json", "dry_run"} - every_command == {
        key for _, key, _ in FLAGS
    }


@pytest.mark.parametrize("flags,key,value", FLAGS, ids=[f[0][0] for f in FLAGS])
def test_a_flag_applies_to_the_registered_schedule(
    home,
    tmp_path,
    monkeypatch,  # noqa: F811
    capsys,
    flags,
    key,
    value,
):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["submit", str(NIGHTLY), *flags]) == cli.EXIT_OK
    value = value.replace("CWD", str(tmp_path)) if isinstance(value, str) else value
    assert getattr(load_spec(NIGHTLY), key) != value  # the YAML alone says otherwise
    [listed] = api.schedules(home)
    assert getattr(load_spec(listed["file"]), key) == value
    assert key in listed["overrides"]
    assert cli.main(["schedules"]) == cli.EXIT_OK
    assert f"registered with {key}=" in capsys.readouterr().out


def test_the_issues_command_reaches_the_jobs_the_cron_submits(home, capsys):  # noqa: F811
    argv = ["submit", str(NIGHTLY), "--max-tokens-cap", "16", "-o", "{home}/results/x/{date}"]
    assert cli.main(argv) == cli.EXIT_OK
    registered = home / "schedules" / "nightly-summaries.yaml"
    cron = Cron(Queue(home))
    cron.add_schedule(registered)
    when = datetime.datetime(2026, 3, 1, 2, 0)
    record = cron.submit_schedule("nightly-summaries", registered, when)
    assert record.spec.max_tokens_cap == 16
    assert record.output_dir.parent == home / "results" / "x"
    capsys.readouterr()
    assert cli.main(["schedules", "--json"]) == cli.EXIT_OK
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["output_dir"] == "{home}/results/x/{date}"
    assert listed["overrides"] == {"max_tokens_cap": 16, "output_dir": listed["output_dir"]}


def test_now_queues_the_same_settings_it_registers(home, capsys):  # noqa: F811
    argv = ["submit", str(NIGHTLY), "--now", "--json", "--max-tokens-cap", "16"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr()
    job = json.loads(out.out)  # stdout is the job's JSON alone; what was registered goes to stderr
    assert "scheduled 'nightly-summaries'" in out.err
    assert api.Job(job["id"], home).record.spec.max_tokens_cap == 16
    assert load_spec(home / "schedules" / "nightly-summaries.yaml").max_tokens_cap == 16


def test_json_without_now_prints_the_registered_schedule(home, capsys):  # noqa: F811
    assert cli.main(["submit", str(NIGHTLY), "--json", "--seed", "3"]) == cli.EXIT_OK
    listed = json.loads(capsys.readouterr().out)
    assert listed["name"] == "nightly-summaries" and listed["overrides"] == {"seed": 3}
    assert not (home / "jobs").exists()


def test_a_bad_flag_registers_nothing(home, capsys):  # noqa: F811
    assert cli.main(["submit", str(NIGHTLY), "--max-tokens-cap", "0"]) == cli.EXIT_REFUSED
    assert "max_tokens_cap" in capsys.readouterr().err
    assert not (home / "schedules").exists() and not (home / "jobs").exists()
