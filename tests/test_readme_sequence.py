"""The README's documented sequence, run as written and in order on a fresh home with the fake
engine: the main job, then the batch-jobs block (submit, worker, status, status --watch, the
answers read with `results --text`, examples/enqueue.py). The queued job generates its rows, and the
example from another program completes beside the main job's results."""

from __future__ import annotations

import os
import re

import pytest

import dflash_batch
from dflash_batch import api, cli
from dflash_batch.errors import SpecError
from tests.helpers import README, SET_UP, sh, shell_blocks, shim
from tests.runner_fixtures import (  # noqa: F401  (fixtures)
    Worker,
    engine,
    fake_models,
    home,
    write_jsonl,
)

ASSIGN = re.compile(r"^(\w+)=\$\((.*)\)$")  # VAR=$(command)


def batch_jobs_block() -> list:
    """The command lines of the README's batch-jobs block, comments dropped."""
    [block] = [
        b
        for b in shell_blocks(README)
        if "dflash-batch submit examples/prompts.jsonl --name queued-example" in b
    ]
    return [line.split(" # ")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_sequence_runs_as_written(tmp_path, home, fake_models):  # noqa: F811
    env = dict(os.environ, DFLASH_BATCH_HOME=str(home))
    bin_dir = shim(tmp_path)
    main_job = SET_UP[0].split(" && ", 1)[1]  # after `bash .ci/install`
    done = sh(main_job, bin_dir, env)
    assert done.returncode == 0, done.stderr
    [first] = api.jobs(home)
    assert first.status()["ok"] == 8

    worker = None
    try:
        for line in batch_jobs_block():
            if line == ".venv/bin/dflash-batch worker":  # "another terminal"
                worker = Worker(home, tmp_path / "worker.log")
                continue
            assigned = ASSIGN.match(line)
            out = sh(assigned.group(2) if assigned else line, bin_dir, env)
            assert out.returncode == 0, f"{line}\n{out.stdout}\n{out.stderr}"
            if assigned:
                env[assigned.group(1)] = out.stdout.strip()
                # the queued job generates: its rows are not the main job's
                assert "8 items in 1 chunk(s) queued" in out.stderr, out.stderr
            if line.endswith("--text"):  # each of the 8 answers, under its id
                assert out.stdout.count("--- ") == 8, out.stdout
            if "enqueue.py" in line:
                assert "completed: 8/8 items done; 8 rows: 8 ok, 0 failed" in out.stdout
        assert worker is not None, "the block starts no worker"
        assert worker.stop() == 0
    finally:
        if worker is not None:
            worker.close()
    jobs = {j.record.data["name"]: j for j in api.jobs(home)}
    assert set(jobs) == {first.record.data["name"], "queued-example", "enqueue-example"}
    queued = jobs["queued-example"]
    assert queued.id == env["JOB"] and queued.status()["state"] == "completed"
    assert len({j.output_dir for j in jobs.values()}) == 3  # each wrote its own rows
    assert all(j.status()["ok"] == 8 for j in jobs.values())


@pytest.fixture
def claimed(tmp_path, home, engine):  # noqa: F811
    """An input whose default output folder holds the rows of another config."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "one two three"}])
    dflash_batch.run(src, engine=engine, max_tokens=3)
    return src


def test_the_python_api_names_its_arguments(claimed, home, engine):  # noqa: F811
    with pytest.raises(SpecError) as refused:
        dflash_batch.submit(claimed, max_tokens=5)
    message = str(refused.value)
    assert "force=True" in message and "output_dir=" in message and "--force" not in message
    assert len(api.jobs(home)) == 1  # the refused submit left no record


def test_the_command_line_names_its_flags(claimed, home, capsys):  # noqa: F811
    assert cli.main(["submit", str(claimed), "--max-tokens", "5"]) == cli.EXIT_REFUSED
    message = capsys.readouterr().err
    assert "--force" in message and "--output-dir" in message and "force=True" not in message
    assert len(api.jobs(home)) == 1


def test_a_resubmit_with_nothing_to_do_says_how_to_generate_again(
    claimed,
    home,  # noqa: F811
    capsys,
):
    assert cli.main(["submit", str(claimed), "--max-tokens", "3"]) == cli.EXIT_OK
    said = capsys.readouterr().err
    assert "nothing queued" in said and "--name" in said


def test_a_setup_refusal_names_the_flag_and_the_argument():
    """The queue's set-up checks run under both front ends: their advice names both."""
    from dflash_batch.runner import scaleout

    mountinfo = (
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / /mnt/shared rw - nfs4 server:/x rw\n"
    )
    with pytest.raises(scaleout.SetupError) as refused:
        scaleout.check_sqlite_home("/mnt/shared/home", mountinfo)
    message = str(refused.value)
    assert all(name in message for name in ("--home", "home=", "--redis", "redis_url="))


def test_a_folder_taken_before_the_job_ran_names_both_ways_past_it(
    tmp_path,
    home,  # noqa: F811
    engine,
):
    """Submitted, then another config claims the folder before a worker gets to it: the job
    fails with a message for either front end."""
    from dflash_batch.errors import ConfigChanged
    from dflash_batch.runner.execution import run_chunk

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "one two three"}])
    job = dflash_batch.submit(src, max_tokens=3)
    job.record.store().write_manifest(config_hash="0" * 16)
    with pytest.raises(ConfigChanged) as failed:
        run_chunk(job.record, 0, lambda spec: engine)
    assert "--force" in str(failed.value) and "force=True" in str(failed.value)
