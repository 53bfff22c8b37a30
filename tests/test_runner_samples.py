"""n samples per row through the runner: job specs, the CLI, row and OpenAI ``n``, one result row
per sample (``sample_index``), seeds from the job's seed, the item id and the sample index, every
sample written exactly once across reruns, OpenAI output with one choice per sample."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest

import dflash_batch
from dflash_batch.request import sample_seed
from dflash_batch.runner.spec import SpecError, load_spec
from dflash_batch.runner.store import ResultStore
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

ROWS = [{"id": "a", "prompt": "Tell me a story."}, {"id": "b", "prompt": "Name a colour.", "n": 1},
        {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "Hi"}], "n": 2}}]  # fmt: skip


def test_each_sample_is_a_row_seeded_from_the_job_seed_item_and_index(tmp_path, home, real_engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    job = dflash_batch.run(src, engine=real_engine, n=3, temperature=1.0, seed=5, max_tokens=8,
                           output_dir=str(tmp_path / "out"))  # fmt: skip
    df = job.to_pandas().sort_values(["id", "sample_index"])
    assert list(zip(df["id"], df["sample_index"])) == [
        ("a", 0),
        ("a", 1),
        ("a", 2),
        ("b", 0),
        ("c", 0),
        ("c", 1),
    ]
    assert (df["status"] == "ok").all()
    for prompt, item in (("Tell me a story.", "a"), ([{"role": "user", "content": "Hi"}], "c")):
        rows = df[df["id"] == item]
        for k, text in zip(rows["sample_index"], rows["output"]):
            alone = real_engine.generate(
                prompt, max_tokens=8, temperature=1.0, seed=sample_seed(5, k, item)
            )
            assert text == alone.text, (item, k)
    assert df[df["id"] == "a"]["output"].nunique() > 1  # samples of their own
    status = job.status()
    assert (status["state"], status["ok"]) == ("completed", 6)


def test_a_lost_sample_is_generated_again_and_only_it(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS[:2])
    out = tmp_path / "out"
    dflash_batch.run(src, engine=engine, n=3, max_tokens=4, output_dir=str(out))
    store = ResultStore(out)
    [part] = store.parts()
    table = pq.read_table(part)
    keep = [
        not (i == "a" and k == 1)
        for i, k in zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist())
    ]
    import pyarrow as pa

    pq.write_table(table.filter(pa.array(keep)), part)  # sample 1 of "a" lost
    again = CountingEngine(engine)
    dflash_batch.run(src, engine=again, n=3, max_tokens=4, output_dir=str(out))
    assert again.calls == ["Tell me a story."]
    df = pd.read_parquet(out)
    assert sorted(zip(df["id"], df["sample_index"])) == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    none = CountingEngine(engine)
    dflash_batch.run(src, engine=none, n=3, max_tokens=4, output_dir=str(out))
    assert none.calls == []


def test_openai_output_has_one_choice_per_sample(tmp_path, home, engine):
    src = write_jsonl(tmp_path / "in.jsonl", ROWS)
    dflash_batch.run(
        src, engine=engine, n=2, max_tokens=3, export_openai=True, output_dir=str(tmp_path / "out")
    )
    lines = [
        json.loads(x) for x in (tmp_path / "out" / "_openai_output.jsonl").read_text().splitlines()
    ]
    by_id = {x["custom_id"]: x["response"]["body"] for x in lines}
    assert len(lines) == 3
    assert [c["index"] for c in by_id["a"]["choices"]] == [0, 1] and [
        c["index"] for c in by_id["b"]["choices"]
    ] == [0]
    assert by_id["a"]["usage"]["completion_tokens"] == 6


def test_n_is_checked_in_specs_rows_and_the_cli(tmp_path, home, fake_models):
    with pytest.raises(SpecError, match="'n' must be an integer from 1 to 1024"):
        load_spec({"input": str(write_jsonl(tmp_path / "x.jsonl", ROWS)), "sampling": {"n": 0}})
    assert load_spec({"input": str(tmp_path / "x.jsonl")}).config_hash() == load_spec(
        {"input": str(tmp_path / "x.jsonl"), "sampling": {"n": 1}}).config_hash()  # fmt: skip
    assert load_spec({"input": str(tmp_path / "x.jsonl"), "sampling": {"n": 2}}).n == 2
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi", "n": 0}, {"id": "b", "prompt": "Yo"}]
    )
    out = tmp_path / "out"
    cli("run", src, "--target", fake_models["target"], "--n", "2", "--output-dir", out, home=home)
    df = pd.read_parquet(out)
    assert sorted(zip(df["id"], df["sample_index"], df["status"])) == [
        ("a", 0, "error"),
        ("b", 0, "ok"),
        ("b", 1, "ok"),
    ]
    assert "'n' must be an integer from 1 to 1024" in df[df["id"] == "a"]["error"].iloc[0]


def test_a_jobs_shared_system_prompt_is_prefilled_once(tmp_path, home, tiny_models):
    """Every item starts with the job's long system prompt: the engine prefills it once and every
    row equals the job run with prefix sharing off (--prefix-cache-mb 0 in the spec)."""
    from dflash_batch.engine import load_engine

    system = " ".join(f"Rule {i}: answer briefly and kindly." for i in range(40))
    src = write_jsonl(
        tmp_path / "in.jsonl",
        [{"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(5)],
    )
    shared = load_engine(tiny_models["target"], tiny_models["draft"])
    job = dflash_batch.run(
        src, engine=shared, system_prompt=system, max_tokens=6, output_dir=str(tmp_path / "a")
    )
    spec = load_spec(
        {
            "input": str(src),
            "model": {
                "target": tiny_models["target"],
                "draft": tiny_models["draft"],
                "prefix_cache_mb": 0,
            },
        }
    )
    off = load_engine(**spec.model)
    ref = dflash_batch.run(
        src, engine=off, system_prompt=system, max_tokens=6, output_dir=str(tmp_path / "b")
    )
    rows, ref_rows = job.to_pandas().set_index("id"), ref.to_pandas().set_index("id")
    assert off.prefixes is None and off.prefill_counts["tokens"] == rows["prompt_tokens"].sum()
    assert (
        shared.prefill_counts["tokens"] <= rows["prompt_tokens"].sum() - 4 * 256
    )  # the prompt's 300+ shared tokens once
    assert (rows.loc[ref_rows.index, "output"] == ref_rows["output"]).all()
    assert (
        spec.config_hash()
        == load_spec(
            {"input": str(src), "model": {k: spec.model[k] for k in ("target", "draft")}}
        ).config_hash()
    )
