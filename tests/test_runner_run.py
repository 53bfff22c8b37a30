"""Foreground runs with a real tiny engine: results schema, resume, error rows, config guard,
retry, exports, the lock, and the CLI's messages and exit codes."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest

import dflash_batch
from dflash_batch import api
from dflash_batch.runner.items import InputError
from dflash_batch.runner.lock import DirLock, Locked, is_locked
from dflash_batch.runner.spec import SpecError
from dflash_batch.runner.store import RESULT_SCHEMA, ResultStore, read_journal
from tests.runner_fixtures import (
    CountingEngine,
    cli,
    engine,
    fake_models,
    home,
    real_engine,
    tiny_models,
    write_jsonl,
)  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt number {i}: tell me something."} for i in range(7)]


def test_run_writes_complete_parquet_set_with_stats(tmp_path, home, real_engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS + [{"id": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                          "metadata": {"topic": "t"}}])  # fmt: skip
    job = dflash_batch.run(
        src, engine=real_engine, max_tokens=6, chunk_size=3, output_dir=str(tmp_path / "out")
    )
    status = job.status()
    assert (status["state"], status["total"], status["ok"], status["failed"]) == (
        "completed",
        8,
        8,
        0,
    )
    assert status["mean_decode_tps"] > 0
    df = pd.read_parquet(tmp_path / "out")
    assert sorted(df["id"]) == sorted([p["id"] for p in PROMPTS] + ["m"])
    assert pq.read_schema(ResultStore(tmp_path / "out").parts()[0]).equals(
        RESULT_SCHEMA, check_metadata=False
    )
    row = df.set_index("id").loc["m"]
    assert row["completion_tokens"] <= 3 and row["finish_reason"] in ("stop", "length")
    assert json.loads(row["metadata"]) == {"topic": "t"}
    ok = df.set_index("id").loc["p0"]
    assert ok["status"] == "ok" and ok["completion_tokens"] == 6 and ok["block_size"] == 8
    assert ok["verify_cycles"] >= 1 and ok["drafted_tokens"] >= ok["accepted_tokens"] >= 0
    assert sum(k * n for k, n in enumerate(ok["acceptance_histogram"])) == pytest.approx(
        ok["tokens_per_cycle"] * ok["verify_cycles"]
    )
    assert ok["decode_tps"] > 0 and ok["prefill_tps"] > 0 and ok["peak_memory_gb"] > 0
    assert ok["config_hash"] == status["config_hash"] and ok["job_id"] == job.id
    assert ok["started_at"] <= ok["finished_at"]
    assert len(job.to_pandas()) == 8
    assert (
        not list((tmp_path / "out").glob(".*.tmp")) and not ResultStore(tmp_path / "out").journals()
    )


def test_acceptance_columns_with_an_agreeing_pair(tmp_path, home, tiny_models, chain_drafts):
    """With a drafter that always agrees, every drafted token is accepted. The engine verifies the
    whole block every cycle here: the default adaptive width may decode a job this short plainly
    (a drafter of unknown worth is probed only where a probe costs at most 5% of the job;
    engine/widths.py), and then there is no acceptance to report (the columns are null, below)."""
    from dflash_batch.engine import load_engine

    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    engine = load_engine(tiny_models["agreeing_target"], tiny_models["draft"], adaptive_block=False)
    job = dflash_batch.run(src, engine=engine, max_tokens=20, output_dir=str(tmp_path / "fixed"))
    df = job.to_pandas()
    assert (df["acceptance_drafted"] == 1.0).all() and (df["accepted_tokens"] > 0).all()
    assert (df["acceptance_generated"] == df["accepted_tokens"] / df["completion_tokens"]).all()
    assert (df["tokens_per_cycle"] > 1).all()
    assert job.status()["mean_acceptance_drafted"] == 1.0

    # the default engine: where it drafted, all accepted; where it did not, null rates, one token a cycle
    job = dflash_batch.run(src, target=tiny_models["agreeing_target"], draft=tiny_models["draft"], max_tokens=20,
                           output_dir=str(tmp_path / "adaptive"))  # fmt: skip
    df = job.to_pandas()
    drafted = df["drafted_tokens"] > 0
    assert (df.loc[drafted, "acceptance_drafted"] == 1.0).all() and (
        df.loc[drafted, "tokens_per_cycle"] > 1
    ).all()
    assert (
        df.loc[~drafted, "acceptance_drafted"].isna().all()
        and (df.loc[~drafted, "tokens_per_cycle"] == 1).all()
    )


def test_rerun_skips_done_items_and_finishes_the_rest(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    out = tmp_path / "out"
    first = CountingEngine(engine)
    dflash_batch.run(src, engine=first, max_tokens=4, chunk_size=2, output_dir=str(out))
    assert len(first.calls) == 7
    again = CountingEngine(engine)
    dflash_batch.run(src, engine=again, max_tokens=4, chunk_size=2, output_dir=str(out))
    assert again.calls == []
    grown = write_jsonl(tmp_path / "in.jsonl", PROMPTS + [{"id": "new", "prompt": "A new one."}])
    more = CountingEngine(engine)
    job = dflash_batch.run(grown, engine=more, max_tokens=4, chunk_size=2, output_dir=str(out))
    assert more.calls == ["A new one."]
    df = pd.read_parquet(out)
    assert df["id"].is_unique and len(df) == 8 and job.status()["state"] == "completed"


def test_bad_rows_become_error_rows_and_the_job_completes(tmp_path, home, fake_models):
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join([
        b'{"id": "good", "prompt": "Hello there"}',
        b'{"id": "json", "prompt": ',
        b'{"id": "empty", "prompt": ""}',
        b'{"id": "long", "prompt": "' + b"word " * 200 + b'"}',
        b'{"id": "utf8", "prompt": "\xff"}',
        b'{"id": "type", "prompt": {"nested": true}}',
        b'{"id": "good2", "messages": [{"role": "user", "content": "Hi"}]}',
    ]) + b"\n")  # fmt: skip
    job = dflash_batch.run(
        src, target=fake_models["target"], draft=fake_models["draft"], max_context=64, max_tokens=4
    )
    df = job.to_pandas().set_index("id")
    assert job.status()["state"] == "completed" and len(df) == 7
    assert set(df.index[df["status"] == "ok"]) == {"good", "good2"}
    errors = df["error"].to_dict()
    unparsed = (
        df.reset_index().set_index("input_index").loc[1]
    )  # a row that is not JSON keeps a derived id
    assert unparsed["id"].startswith("mixed-000001-") and unparsed["error"].startswith(
        "line 2: not valid JSON"
    )
    assert errors["empty"] == "line 3: 'prompt' is empty"
    assert (
        errors["long"].startswith("line 4: PromptTooLongError: prompt has")
        and "context is 64" in errors["long"]
    )
    assert "line 5: not valid UTF-8" in errors["utf8"]
    assert "line 6: 'prompt' must be a string, got an object" in errors["type"]
    assert df.loc["long", "finish_reason"] is None or pd.isna(df.loc["long", "finish_reason"])


def test_per_item_engine_exception_is_an_error_row(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:3])
    flaky = CountingEngine(engine, fail_ids=[PROMPTS[1]["prompt"]])
    job = dflash_batch.run(src, engine=flaky, max_tokens=3)
    df = job.to_pandas().set_index("id")
    assert df.loc["p1", "error"] == "line 2: RuntimeError: simulated failure"
    assert (df.drop("p1")["status"] == "ok").all() and job.status()["failed"] == 1


def test_retry_failed_only_regenerates_just_the_error_rows(tmp_path, home, engine, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:4])
    job = dflash_batch.run(
        src,
        engine=CountingEngine(engine, fail_ids=[PROMPTS[2]["prompt"]]),
        max_tokens=3,
        chunk_size=2,
    )
    assert job.status()["failed"] == 1
    counts = api.retry(job.id, failed_only=True)
    assert counts == {"failed_dropped": 1, "items": 1, "chunks": 1}
    # Run the queued chunk in this process, as a worker would.
    from dflash_batch.runner.execution import run_chunk

    again = CountingEngine(engine)
    for chunk in job.record.pending_chunks():
        run_chunk(job.record, chunk, lambda spec: again)
    assert again.calls == [PROMPTS[2]["prompt"]]
    df = job.to_pandas()
    assert df["id"].is_unique and len(df) == 4 and (df["status"] == "ok").all()
    assert job.status()["state"] == "completed"


def test_changed_config_is_refused_unless_forced(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    out = str(tmp_path / "out")
    dflash_batch.run(src, engine=engine, max_tokens=3, output_dir=out)
    with pytest.raises(SpecError, match=r"holds results made with another model/sampling config"):
        dflash_batch.run(src, engine=engine, max_tokens=5, output_dir=out)
    forced = CountingEngine(engine)
    write_jsonl(tmp_path / "in.jsonl", PROMPTS[:3])
    dflash_batch.run(src, engine=forced, max_tokens=5, output_dir=out, force=True)
    assert len(forced.calls) == 1  # rows already there are kept, and carry their own config_hash
    assert pd.read_parquet(out)["config_hash"].nunique() == 2


def test_lock_blocks_a_second_runner_and_dies_with_its_holder(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    out = tmp_path / "out"
    with DirLock(out):
        assert is_locked(out)
        with pytest.raises(Locked, match=r"in use by pid"):
            dflash_batch.run(src, engine=engine, max_tokens=3, output_dir=str(out))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from dflash_batch.runner.lock import DirLock; DirLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(600)"), str(out)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert is_locked(out)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        holder.kill()
    assert not is_locked(out)  # the kernel dropped the dead holder's lock
    assert (
        dflash_batch.run(src, engine=engine, max_tokens=3, output_dir=str(out)).status()["state"]
        == "completed"
    )


def test_journal_recovery_after_a_torn_write(tmp_path):
    store = ResultStore(tmp_path / "out")
    journal = store.journal(0)
    for i in range(3):
        journal.append(
            {"id": f"r{i}", "status": "ok", "output": "x", "started_at": 1.0, "finished_at": 2.0}
        )
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b'{"id": "r3", "status": "o')  # killed mid-write
    assert [r["id"] for r in read_journal(journal.path)] == ["r0", "r1", "r2"]
    assert store.done_ids() == {"r0", "r1", "r2"}
    store.write_part(
        [{"id": "r0", "status": "ok", "started_at": 1.0, "finished_at": 2.0}], 0
    )  # committed, not yet unlinked
    assert store.recover() == 2
    df = pd.read_parquet(tmp_path / "out")
    assert sorted(df["id"]) == ["r0", "r1", "r2"] and not store.journals()


def test_export_openai_and_results_formats(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}},
                                               {"custom_id": "b", "body": {"prompt": ""}}])  # fmt: skip
    job = dflash_batch.run(src, engine=engine, export_openai=True, output_dir=str(tmp_path / "out"))
    lines = [
        json.loads(x) for x in (tmp_path / "out" / "_openai_output.jsonl").read_text().splitlines()
    ]
    by_id = {x["custom_id"]: x for x in lines}
    body = by_id["a"]["response"]["body"]
    assert by_id["a"]["error"] is None and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and isinstance(
        body["choices"][0]["message"]["content"], str
    )
    assert (
        by_id["b"]["response"] is None
        and "'body.prompt' is empty" in by_id["b"]["error"]["message"]
    )
    out = cli("results", job.id, "--format", "jsonl", home=home, check=True)
    assert sorted(json.loads(x)["id"] for x in out.stdout.splitlines()) == ["a", "b"]
    cli(
        "results",
        job.id,
        "--format",
        "parquet",
        "--out",
        tmp_path / "all.parquet",
        home=home,
        check=True,
    )
    assert len(pd.read_parquet(tmp_path / "all.parquet")) == 2


def test_cli_messages_and_exit_codes(tmp_path, home, tiny_models):
    missing = cli("run", tmp_path / "missing.jsonl", home=home)
    assert missing.returncode == 2 and "missing.jsonl: no such file" in missing.stderr
    (tmp_path / "job.yaml").write_text(
        f"input: {tmp_path / 'x.jsonl'}\nsampling: {{max_tokenz: 3}}\n"
    )
    bad = cli("submit", tmp_path / "job.yaml", home=home)
    assert (
        bad.returncode == 2
        and "unknown key 'sampling.max_tokenz' (did you mean 'max_tokens'?)" in bad.stderr
    )
    dup = write_jsonl(
        tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]
    )
    out = cli("submit", dup, home=home)
    assert out.returncode == 2 and "duplicate id 'a' on line 1 and line 2" in out.stderr
    assert cli("status", "no-such-job", home=home).returncode == 4
    assert cli("bogus", home=home).returncode == 2
    helped = cli("--help", home=home)
    assert (
        helped.returncode == 0
        and "dflash-batch submit" in helped.stdout
        and "worker" in helped.stdout
    )
    trainer = cli("train-drafter", "--help", home=home)
    if importlib.util.find_spec("dflash_batch.training") is not None:
        assert trainer.returncode == 0 and "dflash-batch train-drafter" in trainer.stdout
    else:
        assert trainer.returncode == 2 and "training is not available" in trainer.stderr
    ran = cli("run", write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2]), "--target", tiny_models["target"], "--draft",
              tiny_models["draft"], "--max-tokens", "3", "--no-progress", "--json", home=home, check=True)  # fmt: skip
    status = json.loads(ran.stdout)
    assert status["state"] == "completed" and status["ok"] == 2
    listed = cli("status", "--json", home=home, check=True)
    assert [s["id"] for s in json.loads(listed.stdout)] == [status["id"]]


def test_input_errors_are_raised_before_any_work(tmp_path, home, engine):
    table_path = tmp_path / "wrong.parquet"
    pq.write_table(__import__("pyarrow").table({"text": ["a"]}), table_path)
    with pytest.raises(InputError, match=r"no prompt column 'prompt'.*columns: text"):
        dflash_batch.run(table_path, engine=engine)
    job = dflash_batch.run(table_path, engine=engine, prompt_field="text", max_tokens=2)
    assert job.status()["ok"] == 1


def test_train_drafter_without_the_training_module(monkeypatch, capsys):
    from dflash_batch.cli import main

    monkeypatch.setitem(sys.modules, "dflash_batch.training.cli", None)  # as if not installed
    assert main(["train-drafter", "--help"]) == 2
    assert "drafter training is not available" in capsys.readouterr().err


# -- exit codes, closed pipes, precedence, resubmission, exports, rates --------------------------
def tiny_flags(tiny_models, *extra):
    return [
        "--target",
        tiny_models["target"],
        "--draft",
        tiny_models["draft"],
        "--no-progress",
        *map(str, extra),
    ]


def test_run_exit_codes_say_how_the_job_went(tmp_path, home, fake_models):
    ok = cli(
        "run",
        write_jsonl(tmp_path / "ok.jsonl", PROMPTS[:2]),
        *tiny_flags(fake_models, "--max-tokens", 3),
        home=home,
    )
    assert ok.returncode == 0, ok.stderr
    some = write_jsonl(tmp_path / "some.jsonl", [PROMPTS[0], {"id": "e", "prompt": ""}])
    out = cli("run", some, *tiny_flags(fake_models, "--max-tokens", 3), home=home)
    assert out.returncode == 5 and "1 of 2 rows failed" in out.stderr
    every = write_jsonl(
        tmp_path / "every.jsonl", [{"id": "e", "prompt": ""}, {"id": "f", "messages": []}]
    )
    out = cli("run", every, *tiny_flags(fake_models, "--max-tokens", 3), home=home)
    assert out.returncode == 5 and "2 of 2 rows failed" in out.stderr
    # a job-level failure: the model does not load; the job is marked failed, no traceback
    out = cli("run", tmp_path / "ok.jsonl", "--target", tmp_path / "no-model", "--no-draft", "--output-dir",
              tmp_path / "failed", "--no-progress", home=home)  # fmt: skip
    assert (
        out.returncode == 1
        and "failed: FileNotFoundError" in out.stderr
        and "Traceback" not in out.stderr
    )
    [failed] = [
        s
        for s in json.loads(cli("status", "--json", home=home, check=True).stdout)
        if s["state"] == "failed"
    ]
    assert "no-model" in failed["error"]
    # refused: nothing is created
    jobs_before = sorted((home / "jobs").iterdir())
    for flags in (["--temperature", "nan"], ["--temperature", "inf"], ["--temperature=-inf"]):
        out = cli("run", tmp_path / "ok.jsonl", *tiny_flags(fake_models, *flags), home=home)
        assert out.returncode == 2 and "'temperature' must be a finite number >= 0" in out.stderr, (
            out.stderr
        )
    (tmp_path / "nan.yaml").write_text(
        f"input: ok.jsonl\nsampling: {{temperature: .nan}}\nmodel: {fake_models['target']}\n"
    )
    out = cli("run", tmp_path / "nan.yaml", home=home)
    assert (
        out.returncode == 2
        and "nan.yaml: 'temperature' must be a finite number >= 0, got nan" in out.stderr
    )
    assert sorted((home / "jobs").iterdir()) == jobs_before
    out = cli("worker", "--shutdown-timeout", "nan", home=home)
    assert (
        out.returncode == 2
        and "--shutdown-timeout: must be a finite number of seconds" in out.stderr
    )


def test_output_to_a_closed_pipe_stops_quietly(tmp_path, home, engine):
    from tests.runner_fixtures import REPO

    job = dflash_batch.run(write_jsonl(tmp_path / "in.jsonl", PROMPTS), engine=engine, max_tokens=3)
    env = dict(__import__("os").environ, DFLASH_BATCH_HOME=str(home))
    for args in (["results", job.id, "--format", "jsonl"], ["results", job.id, "--format", "openai"],
                 ["status"], ["status", job.id, "--json"]):  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "dflash_batch.cli", *args], env=env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        proc.stdout.close()  # the reader is gone before the first byte, as `| head -c 0` would be
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141, (args, err)
        assert (
            "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
        ), err
    head = subprocess.run(f"{sys.executable} -m dflash_batch.cli results {job.id} --format jsonl | head -c 400",
                          shell=True, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert len(head.stdout) == 400 and head.stderr == ""


class RecordingEngine(CountingEngine):
    """Records the options of each request."""

    def __init__(self, engine):
        super().__init__(engine)
        self.kwargs = {}

    def seen(self, request):
        prompt = request.prompt
        self.kwargs[prompt if isinstance(prompt, str) else prompt[-1]["content"]] = (
            request.options.as_kwargs()
        )
        super().seen(request)


def test_rows_own_settings_win_and_the_cap_bounds_every_row(tmp_path, home, engine, fake_models):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "own", "prompt": "own", "max_tokens": 9, "temperature": 0.5},
        {"id": "job", "prompt": "job"},
        {"custom_id": "body", "body": {"prompt": "body", "max_completion_tokens": 12}},
    ])  # fmt: skip
    free = RecordingEngine(engine)
    dflash_batch.run(
        src, engine=free, max_tokens=4, temperature=0.0, seed=1, output_dir=str(tmp_path / "a")
    )
    assert {k: v["max_tokens"] for k, v in free.kwargs.items()} == {"own": 9, "job": 4, "body": 12}
    assert {k: v["temperature"] for k, v in free.kwargs.items()} == {
        "own": 0.5,
        "job": 0.0,
        "body": 0.0,
    }
    capped = RecordingEngine(engine)
    job = dflash_batch.run(
        src, engine=capped, max_tokens=4, max_tokens_cap=5, output_dir=str(tmp_path / "b")
    )
    assert {k: v["max_tokens"] for k, v in capped.kwargs.items()} == {"own": 5, "job": 4, "body": 5}
    assert job.to_pandas()["completion_tokens"].max() <= 5
    out = cli(
        "run",
        src,
        *tiny_flags(fake_models, "--max-tokens-cap", 2),
        "--output-dir",
        tmp_path / "c",
        "--json",
        home=home,
    )
    assert out.returncode == 0 and pd.read_parquet(tmp_path / "c")["completion_tokens"].max() == 2
    (tmp_path / "cap.yaml").write_text(
        "input: in.jsonl\nsampling: {max_tokens: 64, max_tokens_cap: 3}\n"
    )
    assert (
        api.load_spec(tmp_path / "cap.yaml").generation_options({"max_tokens": 100})["max_tokens"]
        == 3
    )
    # the cap changes what is generated (so the config hash); without it, hashes are as before it existed
    spec = {
        "input": "/nonexistent/x.jsonl",
        "model": {"target": "org/model"},
        "sampling": {"max_tokens": 7},
    }
    assert api.load_spec(spec).config_hash() == "7cf3fe522d6ca01e"
    assert api.load_spec(spec, max_tokens_cap=7).config_hash() != "7cf3fe522d6ca01e"


def test_resubmitting_says_what_is_done_and_queues_only_the_rest(tmp_path, home, engine):
    from dflash_batch.runner.queue import Queue, task_id

    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2] + [{"id": "bad", "prompt": ""}])
    first = dflash_batch.run(src, engine=engine, max_tokens=3, chunk_size=2, export_openai=True)
    (first.output_dir / "_openai_output.jsonl").unlink()
    out = cli(
        "submit",
        src,
        "--max-tokens",
        3,
        "--chunk-size",
        2,
        "--export-openai",
        home=home,
        check=True,
    )
    assert "all 3 items already done (3 rows: 2 ok, 1 failed): nothing queued" in out.stderr
    assert "--failed-only` runs the 1 error rows again" in out.stderr
    again = api.Job(out.stdout.strip())
    assert again.status()["state"] == "completed" and Queue(home).queued_task_ids() == set()
    assert (
        first.output_dir / "_openai_output.jsonl"
    ).exists()  # the job completed: its export is written
    write_jsonl(src, PROMPTS[:2] + [{"id": "bad", "prompt": ""}] + PROMPTS[2:5])  # three new rows
    out = cli(
        "submit",
        src,
        "--max-tokens",
        3,
        "--chunk-size",
        2,
        "--export-openai",
        home=home,
        check=True,
    )
    assert "6 items: 3 already done (3 rows: 2 ok, 1 failed), 3 queued in 2 chunk(s)" in out.stderr
    job_id = out.stdout.strip()
    assert Queue(home).queued_task_ids() == {task_id(job_id, 1), task_id(job_id, 2)}


@pytest.mark.mlx  # reads the default pair's name from the engine package
def test_openai_output_names_the_target(tmp_path, home, fake_models):
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"custom_id": "a", "body": {"model": "whatever", "prompt": "Hi"}}]
    )
    job = dflash_batch.run(
        src,
        target=fake_models["target"],
        draft=fake_models["draft"],
        max_tokens=2,
        export_openai=True,
    )
    [line] = [
        json.loads(x) for x in (job.output_dir / "_openai_output.jsonl").read_text().splitlines()
    ]
    assert line["response"]["body"]["model"] == "target"  # the target folder's name
    out = cli("results", job.id, "--format", "openai", home=home, check=True)
    assert json.loads(out.stdout)["response"]["body"]["model"] == "target"
    assert api.load_spec(src).model_name == "SmolLM2-135M-Instruct"  # the embedded default pair
    from dflash_batch.engine.models import default_model

    assert default_model.GGUF_FILE.startswith(
        "SmolLM2-135M-Instruct."
    )  # the name is the model's own
    assert (
        api.load_spec(src, target="mlx-community/Qwen3-4B-bf16").model_name
        == "mlx-community/Qwen3-4B-bf16"
    )


def test_rates_are_null_where_they_are_undefined(tmp_path, home, fake_models):
    from dflash_batch.completion import GenerationStats

    empty = GenerationStats()
    assert [empty.prefill_tps, empty.decode_tps, empty.tokens_per_cycle, empty.acceptance_drafted,
            empty.acceptance_generated] == [None] * 5  # fmt: skip
    one = GenerationStats(prompt_tokens=4, generated_tokens=1, prefill_s=0.5, decode_s=0.0)
    assert (one.prefill_tps, one.decode_tps, one.tokens_per_cycle, one.acceptance_generated) == (
        8.0,
        None,
        None,
        0.0,
    )
    assert one.to_dict()["decode_tps"] is None
    plain = GenerationStats(generated_tokens=3, decode_s=1.0, cycles=2, acceptance_histogram=[0, 2])
    assert (plain.decode_tps, plain.tokens_per_cycle, plain.acceptance_drafted) == (2.0, 1.0, None)
    job = dflash_batch.run(write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2]), target=fake_models["target"],
                           draft=fake_models["draft"], max_tokens=1)  # fmt: skip
    df = job.to_pandas()
    assert (df["completion_tokens"] == 1).all() and df["prefill_tps"].gt(0).all()
    assert (
        df["decode_tps"].isna().all()
        and df["tokens_per_cycle"].isna().all()
        and df["acceptance_drafted"].isna().all()
    )
    status = job.status()
    assert status["mean_decode_tps"] is None and status["mean_tokens_per_cycle"] is None
    line = cli("status", job.id, home=home, check=True).stdout
    assert "decode tok/s (mean per row) -" in line and "tau -" in line
