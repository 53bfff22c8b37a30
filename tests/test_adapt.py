"""A drafter that learns from its job (issue 39): rows keep their token ids and the revision that
drafted them, `adapt` trains and keeps only a better drafter, the engine swaps drafters between
streams, and every row equals the target's own greedy output whichever drafter drafted it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from dflash_batch.runner import drafters
from dflash_batch.runner.execution import run_job
from dflash_batch.runner.jobs import create_job, load_job
from dflash_batch.runner.spec import load_spec
from tests.helpers import fixed_costs, greedy_reference
from tests.runner_fixtures import REPO, cli, home, tiny_models, workers, write_jsonl  # noqa: F401

TOPICS = [
    "rivers",
    "stars",
    "bread",
    "trains",
    "owls",
    "salt",
    "glass",
    "tides",
    "moss",
    "kites",
    "clocks",
    "bees",
]
PROMPTS = [{"id": f"q{i:02d}", "prompt": f"Say something about {t} number {i}."} for i, t in
           enumerate(TOPICS * 2)]  # fmt: skip
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def pair_engine(tiny_models):
    """The real engine on the tiny pair, fixed pass costs (no timing), drafting every cycle."""
    from dflash_batch.engine import load_engine

    return load_engine(
        tiny_models["target"], tiny_models["draft"], cost_model=fixed_costs(), adaptive_block=False
    )


def make_job(tmp_path, home, tiny_models, prompts=PROMPTS, **extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = write_jsonl(tmp_path / "in.jsonl", prompts)
    spec = load_spec(src, target=tiny_models["target"], draft=tiny_models["draft"], max_tokens=MAX_TOKENS,
                     chunk_size=8, output_dir=str(tmp_path / "out"), **extra)  # fmt: skip
    return create_job(spec, home)


def run_chunks(record, engine, chunks):
    """The worker's way: the job's drafter in force is put in use before each stream."""
    return run_job(record, chunks, lambda spec: drafters.use_in_force(engine, record))


def rows_of(record):
    return {r["id"]: r for r in record.store().read().to_pylist()}


def assert_rows_exact(record, tiny_models, engine):
    """Every row is the target's own greedy continuation of its own prompt ids."""
    eos = set(engine.tokenizer.eos_token_ids)
    for row in rows_of(record).values():
        assert row["status"] == "ok"
        assert row["prompt_token_ids"] == engine.encode(
            next(p["prompt"] for p in PROMPTS if p["id"] == row["id"])
        )
        assert row["token_ids"] == greedy_reference(
            tiny_models["target"], row["prompt_token_ids"], MAX_TOKENS, eos
        ), row["id"]


def adapt(record, **options):
    from dflash_batch.training.adapt import adapt_job

    ticks = iter(range(10**6))
    options = {
        "min_rows": 8,
        "steps": 12,
        "batch_size": 4,
        "anchors": 8,
        "lr": 2e-3,
        "warmup": 2,
        **options,
    }
    with drafters.adapt_lock(record):
        return adapt_job(record, clock=lambda: float(next(ticks)), **options)


def test_rows_keep_token_ids_and_drafter_revision(tmp_path, home, tiny_models, pair_engine):
    record = make_job(tmp_path, home, tiny_models, PROMPTS[:6])
    run_chunks(record, pair_engine, [0])
    rows = rows_of(record)
    assert len(rows) == 6 and all(r["drafter_revision"] is None for r in rows.values())
    assert all(len(r["token_ids"]) == r["completion_tokens"] for r in rows.values())
    assert_rows_exact(record, tiny_models, pair_engine)


def test_a_job_too_small_to_adapt_says_so(tmp_path, home, tiny_models, pair_engine):
    from dflash_batch.training.adapt import AdaptRefused

    record = make_job(tmp_path, home, tiny_models, PROMPTS[:6])
    run_chunks(record, pair_engine, [0])
    with pytest.raises(AdaptRefused, match="6 finished rows .* at least 8"):
        adapt(record)
    assert drafters.state(record) == {"in_force": None, "history": []}


def test_adapt_then_switch_mid_job_rows_stay_exact(tmp_path, home, tiny_models, pair_engine):
    """The first two chunks are drafted by the job's drafter, `adapt` trains on their rows and
    puts a better one in force, the last chunk is drafted by it; all rows are exact, and status
    shows the switch with the acceptance before and after."""
    record = make_job(tmp_path, home, tiny_models)
    run_chunks(record, pair_engine, [0, 1])
    entry = adapt(record)
    assert entry["outcome"] == "adopted", entry
    assert entry["held_out_after"] > entry["held_out_before"] and entry["steps"] == 12
    assert entry["rows"] == 16 and entry["held_out_rows"] >= 1 and entry["from"] is None
    folder = drafters.folder(record) / "rev-0001"
    assert json.loads((folder / "training.json").read_text())["revision"] == "rev-0001"
    assert (folder / "config.json").exists() and not (
        drafters.folder(record) / drafters.WORK
    ).exists()
    run_chunks(record, pair_engine, [2])
    rows = rows_of(record)
    assert {r["drafter_revision"] for r in rows.values()} == {None, "rev-0001"}
    assert sum(r["drafter_revision"] == "rev-0001" for r in rows.values()) == 8
    assert pair_engine.drafter_revision == "rev-0001"
    assert_rows_exact(record, tiny_models, pair_engine)
    status = load_job(home, record.id).status()
    assert status["drafter"]["in_force"] == "rev-0001"
    assert set(status["drafter"]["drafted"]) == {"job", "rev-0001"}
    lines = "\n".join(drafters.summary_lines(status["drafter"]))
    assert "rev-0001 adopted: held-out acceptance" in lines and "in force: rev-0001" in lines

    # another job on the same engine drafts with its own drafter again
    other = make_job(tmp_path / "other", home, tiny_models, PROMPTS[:3])
    run_chunks(other, pair_engine, [0])
    assert (
        pair_engine.drafter_revision is None and pair_engine.drafter is pair_engine.loaded_drafter
    )
    assert {r["drafter_revision"] for r in rows_of(other).values()} == {None}


def test_a_drafter_that_does_not_beat_the_current_one_is_not_kept(
    tmp_path, home, tiny_models, pair_engine
):
    record = make_job(tmp_path, home, tiny_models, PROMPTS[:16])
    run_chunks(record, pair_engine, [0, 1])
    entry = adapt(record, min_gain=1000.0)
    assert entry["outcome"] == "rejected" and entry["revision"] is None
    assert drafters.in_force(record) == (None, None) and not list(
        drafters.folder(record).glob("rev-*")
    )


def test_an_adapted_drafter_that_fails_to_load_is_refused(tmp_path, home, tiny_models, pair_engine):
    record = make_job(tmp_path, home, tiny_models)
    run_chunks(record, pair_engine, [0, 1])
    assert adapt(record)["outcome"] == "adopted"
    (drafters.folder(record) / "rev-0001" / "model.safetensors").write_bytes(
        b"not a safetensors file"
    )
    pair_engine.use_drafter(None)
    run_chunks(record, pair_engine, [2])
    assert drafters.in_force(record) == (None, None)
    assert drafters.state(record)["history"][-1]["outcome"] == "refused"
    assert {r["drafter_revision"] for r in rows_of(record).values()} == {None}
    assert pair_engine.drafter is pair_engine.loaded_drafter
    assert_rows_exact(record, tiny_models, pair_engine)


KILLED_ADAPT = """
import os, signal, sys
from dflash_batch.runner import drafters
from dflash_batch.runner.jobs import load_job
from dflash_batch.training.adapt import adapt_job
record = load_job(sys.argv[1], sys.argv[2])
ticks = iter(range(10**6))
def clock():
    tick = next(ticks)
    if tick == 6:  # mid-training: the process dies as by kill -9
        os.kill(os.getpid(), signal.SIGKILL)
    return float(tick)
with drafters.adapt_lock(record):
    adapt_job(record, clock=clock, min_rows=8, steps=12, batch_size=4, anchors=8, warmup=2)
"""


def test_kill9_during_adaptation_loses_no_row_and_resumes_with_the_drafter_in_force(
    tmp_path, home, tiny_models, pair_engine
):
    record = make_job(tmp_path, home, tiny_models)
    run_chunks(record, pair_engine, [0, 1])
    before = rows_of(record)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", KILLED_ADAPT, str(home), record.id], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert rows_of(record) == before
    assert drafters.state(record) == {"in_force": None, "history": []}
    run_chunks(record, pair_engine, [2])
    assert len(rows_of(record)) == 24 and {
        r["drafter_revision"] for r in rows_of(record).values()
    } == {None}
    assert_rows_exact(record, tiny_models, pair_engine)
    assert (drafters.folder(record) / drafters.WORK).exists()  # what the killed attempt left
    entry = adapt(record)  # the next attempt starts clean, on every row
    assert (
        entry["rows"] == 24
        and entry["outcome"] in ("adopted", "rejected")
        and len(drafters.state(record)["history"]) == 1
    )
    assert not (drafters.folder(record) / drafters.WORK).exists()


def test_adapt_command_and_status(tmp_path, home, tiny_models, pair_engine):
    """`dflash-batch adapt JOB`: refused (exit 2) while the job is too small, then run on the
    job's rows; `status` shows the attempt."""
    record = make_job(tmp_path, home, tiny_models)
    run_chunks(record, pair_engine, [0])
    small = cli("adapt", record.id, "--steps", "4", "--min-rows", "12", home=home)
    assert (
        small.returncode == 2
        and "8 finished rows" in small.stderr
        and "at least 12" in small.stderr
    )
    run_chunks(record, pair_engine, [1])
    done = cli(
        "adapt", record.id, "--steps", "4", "--min-rows", "12", "--json", home=home, check=True
    )
    entry = json.loads(done.stdout)
    assert (
        entry["rows"] == 16 and entry["steps"] == 4 and entry["outcome"] in ("adopted", "rejected")
    )
    assert drafters.state(record)["history"] == [entry]
    shown = cli("status", record.id, home=home, check=True).stdout
    assert f"drafter {entry['revision'] or '-'} {entry['outcome']}: held-out acceptance" in shown


def test_benchmark_smoke(tmp_path, tiny_models):
    """benchmarks/adapt.py --smoke on the tiny pair: the four phases run, and the later rows
    drafted by the adapted drafter equal the same rows drafted by the job's own."""
    out = tmp_path / "adapt.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.adapt", "--smoke", "--target", tiny_models["target"],
                           "--draft", tiny_models["draft"], "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (
        result["later_rows_token_exact"]
        and result["prompts"] == 24
        and result["adaptation"]["rows"] == 16
    )
    assert result["later_rows_adapted"]["rows"] == result["later_rows_shipped"]["rows"] == 8
    assert set(result["times_s"]) == {
        "first_rows_s",
        "adapt_s",
        "later_rows_adapted_s",
        "later_rows_shipped_s",
    }


def test_hybrid_target_adapts_and_rows_stay_exact(tmp_path, home):
    """A tiny hybrid target (Qwen3.5 layout: gated delta-net layers and attention), correctness
    only: the job adapts (a forced adoption is not asked for: kept or not), switches if kept, and
    every row equals mlx-lm's greedy decoding of the target."""
    from dflash_batch.engine import load_engine

    from tests import synthetic

    cfg = synthetic.tiny_qwen3_5_config(layers=4)
    models = {
        "target": str(synthetic.save_target(tmp_path / "t", cfg, seed=0)),
        "draft": str(
            synthetic.save_drafter(
                tmp_path / "d", synthetic.drafter_config(cfg, block_size=8), seed=5
            )
        ),
    }
    engine = load_engine(
        models["target"], models["draft"], cost_model=fixed_costs(), adaptive_block=False
    )
    record = make_job(tmp_path / "job", home, models)
    run_chunks(record, engine, [0, 1])
    entry = adapt(record, steps=4)
    assert entry["rows"] == 16 and entry["outcome"] in ("adopted", "rejected")
    run_chunks(record, engine, [2])
    later = {r["drafter_revision"] for r in rows_of(record).values() if r["id"] >= "q16"}
    assert later == {entry["revision"]}
    assert_rows_exact(record, models, engine)


def test_training_taps_of_a_hybrid_target_equal_its_own_forward(tmp_path):
    """What the trainer learns from on a hybrid target (``tapped_hidden``: recurrent layers
    unmasked, attention causal) is what the model's own forward pass taps."""
    from dflash_batch.engine.models.target import Target

    import mlx.core as mx
    from mlx_lm import load as mlx_load

    from dflash_batch.training.trainer import tapped_hidden
    from tests import synthetic

    folder = synthetic.save_target(tmp_path / "t", synthetic.tiny_qwen3_5_config(layers=4), seed=0)
    target = Target(mlx_load(str(folder))[0], [1, 3])  # a recurrent layer and the attention layer
    tokens = mx.array([[5, 17, 99, 3, 42, 7, 250, 11, 64, 8]])
    trained = tapped_hidden(target, tokens)
    target.model(tokens)
    forward = mx.concatenate(target._store, axis=-1)
    assert mx.allclose(trained, forward, atol=1e-5).item()


def test_a_foreground_run_drafts_with_its_own_job_drafter(tmp_path, home, tiny_models, pair_engine):
    """`run` with an engine another job left on its adapted drafter: this job's rows are drafted
    by this job's drafter (its own), as a worker's would be."""
    import dflash_batch

    record = make_job(tmp_path / "adapted", home, tiny_models)
    run_chunks(record, pair_engine, [0, 1])
    assert adapt(record)["outcome"] == "adopted"
    run_chunks(record, pair_engine, [2])
    assert pair_engine.drafter_revision == "rev-0001"
    src = write_jsonl(tmp_path / "fg.jsonl", PROMPTS[:4])
    job = dflash_batch.run(
        src, engine=pair_engine, max_tokens=MAX_TOKENS, output_dir=str(tmp_path / "fg-out")
    )
    assert {r["drafter_revision"] for r in job.record.store().read().to_pylist()} == {None}
    assert pair_engine.drafter_revision is None


def test_use_drafter_refuses_a_drafter_for_another_target_and_changes_nothing(
    tmp_path, pair_engine
):
    from dflash_batch.completion import ModelMismatchError
    from tests import synthetic

    other = synthetic.tiny_qwen3_config(hidden=64)
    wrong = synthetic.save_drafter(
        tmp_path / "wrong", synthetic.drafter_config(other, block_size=8), seed=2
    )
    pair_engine.use_drafter(None)
    before = (
        pair_engine.drafter,
        pair_engine.block_size,
        pair_engine.target.tap_ids,
        dict(pair_engine.description),
    )
    with pytest.raises(ModelMismatchError, match="hidden size"):
        pair_engine.use_drafter(wrong, "rev-0009")
    after = (
        pair_engine.drafter,
        pair_engine.block_size,
        pair_engine.target.tap_ids,
        pair_engine.description,
    )
    assert after == before and pair_engine.drafter_revision is None


def test_a_queued_job_adapts_by_itself_in_a_worker(
    tmp_path, home, tiny_models, workers, pair_engine
):
    """`adapt:` in the spec, a real `dflash-batch worker`: its first task streams two chunks
    (16 rows), it adapts between tasks, and the last chunk names the revision in force then;
    every row equals the target's own greedy output."""
    import dflash_batch

    src = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    job = dflash_batch.submit(src, target=tiny_models["target"], draft=tiny_models["draft"], max_tokens=MAX_TOKENS,
                              chunk_size=8, batch_size=8, adapt={"after_rows": 16, "steps": 4, "min_rows": 8})  # fmt: skip
    worker = workers("--target", tiny_models["target"], "--draft", tiny_models["draft"])
    assert job.wait(timeout=600)["state"] == "completed", worker.log()[-3000:]
    record = load_job(home, job.id)
    history = drafters.state(record)["history"]
    assert [(h["trigger"], h["rows"], h["steps"]) for h in history] == [("spec", 16, 4)], (
        worker.log()[-3000:]
    )
    rows = rows_of(record)
    assert {rows[f"q{i:02d}"]["drafter_revision"] for i in range(16)} == {None}
    assert {rows[f"q{i:02d}"]["drafter_revision"] for i in range(16, 24)} == {
        history[0]["revision"]
    }
    assert_rows_exact(record, tiny_models, pair_engine)
    assert worker.stop() == 0
