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
from tests.runner_fixtures import CountingEngine, cli, engine, home, tiny_models, write_jsonl  # noqa: F401

PROMPTS = [{"id": f"p{i}", "prompt": f"Prompt number {i}: tell me something."} for i in range(7)]


def test_run_writes_complete_parquet_set_with_stats(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS + [{"id": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                          "metadata": {"topic": "t"}}])  # fmt: skip
    job = dflash_batch.run(src, engine=engine, max_tokens=6, chunk_size=3, output_dir=str(tmp_path / "out"))
    status = job.status()
    assert (status["state"], status["total"], status["ok"], status["failed"]) == ("completed", 8, 8, 0)
    assert status["mean_decode_tps"] > 0
    df = pd.read_parquet(tmp_path / "out")
    assert sorted(df["id"]) == sorted([p["id"] for p in PROMPTS] + ["m"])
    assert pq.read_schema(ResultStore(tmp_path / "out").parts()[0]).equals(RESULT_SCHEMA, check_metadata=False)
    row = df.set_index("id").loc["m"]
    assert row["completion_tokens"] <= 3 and row["finish_reason"] in ("stop", "length")
    assert json.loads(row["metadata"]) == {"topic": "t"}
    ok = df.set_index("id").loc["p0"]
    assert ok["status"] == "ok" and ok["completion_tokens"] == 6 and ok["block_size"] == 8
    assert ok["verify_cycles"] >= 1 and ok["drafted_tokens"] >= ok["accepted_tokens"] >= 0
    assert sum(k * n for k, n in enumerate(ok["acceptance_histogram"])) == pytest.approx(ok["tokens_per_cycle"] * ok["verify_cycles"])
    assert ok["decode_tps"] > 0 and ok["prefill_tps"] > 0 and ok["peak_memory_gb"] > 0
    assert ok["config_hash"] == status["config_hash"] and ok["job_id"] == job.id
    assert ok["started_at"] <= ok["finished_at"]
    assert len(job.to_pandas()) == 8
    assert not list((tmp_path / "out").glob(".*.tmp")) and not ResultStore(tmp_path / "out").journals()


def test_acceptance_columns_with_an_agreeing_pair(tmp_path, home, tiny_models):
    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS[:2])
    job = dflash_batch.run(src, target=tiny_models["agreeing_target"], draft=tiny_models["draft"], max_tokens=20)
    df = job.to_pandas()
    assert (df["acceptance_drafted"] == 1.0).all() and (df["accepted_tokens"] > 0).all()
    assert (df["acceptance_generated"] == df["accepted_tokens"] / df["completion_tokens"]).all()
    assert (df["tokens_per_cycle"] > 1).all()
    assert job.status()["mean_acceptance_drafted"] == 1.0


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


def test_bad_rows_become_error_rows_and_the_job_completes(tmp_path, home, tiny_models):
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
    job = dflash_batch.run(src, target=tiny_models["target"], draft=tiny_models["draft"], max_context=64, max_tokens=4)
    df = job.to_pandas().set_index("id")
    assert job.status()["state"] == "completed" and len(df) == 7
    assert set(df.index[df["status"] == "ok"]) == {"good", "good2"}
    errors = df["error"].to_dict()
    unparsed = df.reset_index().set_index("input_index").loc[1]  # a row that is not JSON keeps a derived id
    assert unparsed["id"].startswith("mixed-000001-") and unparsed["error"].startswith("line 2: malformed JSON")
    assert errors["empty"] == "line 3: 'prompt' is empty"
    assert errors["long"].startswith("line 4: PromptTooLongError: prompt has") and "context is 64" in errors["long"]
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
    job = dflash_batch.run(src, engine=CountingEngine(engine, fail_ids=[PROMPTS[2]["prompt"]]), max_tokens=3, chunk_size=2)
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
    assert dflash_batch.run(src, engine=engine, max_tokens=3, output_dir=str(out)).status()["state"] == "completed"


def test_journal_recovery_after_a_torn_write(tmp_path):
    store = ResultStore(tmp_path / "out")
    journal = store.journal(0)
    for i in range(3):
        journal.append({"id": f"r{i}", "status": "ok", "output": "x", "started_at": 1.0, "finished_at": 2.0})
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b'{"id": "r3", "status": "o')  # killed mid-write
    assert [r["id"] for r in read_journal(journal.path)] == ["r0", "r1", "r2"]
    assert store.done_ids() == {"r0", "r1", "r2"}
    store.write_part([{"id": "r0", "status": "ok", "started_at": 1.0, "finished_at": 2.0}], 0)  # committed, not yet unlinked
    assert store.recover() == 2
    df = pd.read_parquet(tmp_path / "out")
    assert sorted(df["id"]) == ["r0", "r1", "r2"] and not store.journals()


def test_export_openai_and_results_formats(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}},
                                               {"custom_id": "b", "body": {"prompt": ""}}])  # fmt: skip
    job = dflash_batch.run(src, engine=engine, export_openai=True, output_dir=str(tmp_path / "out"))
    lines = [json.loads(x) for x in (tmp_path / "out" / "_openai_output.jsonl").read_text().splitlines()]
    by_id = {x["custom_id"]: x for x in lines}
    body = by_id["a"]["response"]["body"]
    assert by_id["a"]["error"] is None and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and isinstance(body["choices"][0]["message"]["content"], str)
    assert by_id["b"]["response"] is None and "'body.prompt' is empty" in by_id["b"]["error"]["message"]
    out = cli("results", job.id, "--format", "jsonl", home=home, check=True)
    assert sorted(json.loads(x)["id"] for x in out.stdout.splitlines()) == ["a", "b"]
    cli("results", job.id, "--format", "parquet", "--out", tmp_path / "all.parquet", home=home, check=True)
    assert len(pd.read_parquet(tmp_path / "all.parquet")) == 2


def test_cli_messages_and_exit_codes(tmp_path, home, tiny_models):
    missing = cli("run", tmp_path / "missing.jsonl", home=home)
    assert missing.returncode == 2 and "missing.jsonl: no such file" in missing.stderr
    (tmp_path / "job.yaml").write_text(f"input: {tmp_path / 'x.jsonl'}\nsampling: {{max_tokenz: 3}}\n")
    bad = cli("submit", tmp_path / "job.yaml", home=home)
    assert bad.returncode == 2 and "unknown key 'sampling.max_tokenz' (did you mean 'max_tokens'?)" in bad.stderr
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    out = cli("submit", dup, home=home)
    assert out.returncode == 2 and "duplicate id 'a' on line 1 and line 2" in out.stderr
    assert cli("status", "no-such-job", home=home).returncode == 4
    assert cli("bogus", home=home).returncode == 2
    helped = cli("--help", home=home)
    assert helped.returncode == 0 and "dflash-batch submit" in helped.stdout and "worker" in helped.stdout
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
