"""The benchmark harness on tiny models: well-formed results, and scripted acceptance that
lands exactly where it was scripted. No timing assertions (performance lives in benchmarks)."""

import json

import dflash_batch.engine  # noqa: F401  (BLAS before mlx)
from dflash_batch.engine.output import RowOutput

import mlx.core as mx
import pytest

from benchmarks import arms, report, run
from benchmarks.scripted import AcceptanceScript, ScriptedDrafter, head_rows_of, per_token_rate
from tests.helpers import fixed_costs
from tests.runner_fixtures import REPO


@pytest.fixture(scope="module")
def tiny():
    return arms.build_setup("qwen3-tiny", mx.float32)


def test_per_token_rate_inverts_the_truncated_geometric_mean():
    for mean in (0.5, 6.05, 8.57, 13.35):
        q = per_token_rate(mean, 15)
        assert sum(q**k for k in range(1, 16)) == pytest.approx(mean, abs=1e-9)
    with pytest.raises(ValueError):
        per_token_rate(16, 15)


def test_script_draws_average_to_the_requested_rate():
    script = AcceptanceScript.of_drafted(0.89, 16, seed=3)
    for _ in range(20000):
        script.corrupted()
    assert sum(script.drawn) / len(script.drawn) / 15 == pytest.approx(0.89, abs=0.01)
    tau = AcceptanceScript.of_tokens_per_cycle(9.57, 16, seed=4)
    for _ in range(20000):
        tau.corrupted()
    assert 1 + sum(tau.drawn) / len(tau.drawn) == pytest.approx(9.57, abs=0.1)


def _verify_steps(engine, prompt, max_tokens):
    """Every row Step the engine commits for one prompt (its prefill's, then each cycle's)."""
    from dflash_batch.engine.batch import BatchDecoder

    steps, feed = [], RowOutput.feed

    def spy(output, step):
        steps.append(step)
        return feed(output, step)

    request = engine.request(prompt, max_tokens=max_tokens)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(RowOutput, "feed", spy)
        for _ in BatchDecoder(engine, [request], 1, engine._width_policy(1)).steps():
            pass
    return [t for s in steps for t in s.tokens], [s for s in steps if s.decoded]


def _check_cycles_follow_script(cycles, drawn):
    """Every cycle that drafted accepted exactly the script's draw, capped by the rows verified."""
    drafting = [c for c in cycles if c.drafted > 0]  # the budget's last token may need no draft
    assert len(drafting) == len(drawn)
    assert [c.from_draft for c in drafting] == [min(a, c.drafted) for a, c in zip(drawn, drafting)]


def test_scripted_acceptance_on_a_zeroed_norm_target_hits_the_requested_rate(tiny, chain_drafts):
    engine = arms.make_engine(
        tiny, tiny.drafter, adaptive_block=False
    )  # every cycle verifies 16 rows
    script = AcceptanceScript.of_drafted(0.6, engine.block_size, seed=7)
    engine.drafter = arms.scripted_drafter(tiny, script)
    prompt = arms.prompt_ids(40, tiny.vocab_size)
    with arms.zeroed_final_norm(tiny.model):
        tokens, cycles = _verify_steps(engine, prompt, 1000)
        assert tokens == [0] * 1000  # the target's known continuation
        _check_cycles_follow_script(cycles, script.drawn)
        script.reset()
        stats = engine.generate(prompt, max_tokens=1000).stats
    assert stats.acceptance_drafted == pytest.approx(0.6, abs=0.08)
    assert stats.accepted_tokens == sum(c.from_draft for c in cycles)


def test_scripted_drafter_replays_a_recorded_greedy_continuation(tiny, chain_drafts):
    """Random weights, fp32: the target's own greedy output is the reference; proposals built
    from it are accepted exactly where the script says, and the output is unchanged."""
    prompt = arms.prompt_ids(24, tiny.vocab_size, seed=5)
    plain = arms.make_engine(tiny).generate(prompt, max_tokens=150).token_ids
    engine = arms.make_engine(
        tiny, tiny.drafter, adaptive_block=False
    )  # no warm-up passes through the script
    script = AcceptanceScript(q=0.8, block_size=engine.block_size, seed=11)
    engine.drafter = ScriptedDrafter(
        tiny.drafter, head_rows_of(tiny.model), script, tiny.vocab_size, reference=plain + [0] * 32
    )
    tokens, cycles = _verify_steps(engine, prompt, 150)
    assert tokens == plain
    _check_cycles_follow_script(cycles, script.drawn)


def test_random_weights_give_about_one_token_per_cycle(tiny):
    engine = arms.make_engine(tiny, tiny.drafter, cost_model=fixed_costs())
    stats = engine.generate(arms.prompt_ids(32, tiny.vocab_size), max_tokens=60).stats
    assert stats.tokens_per_cycle < 1.5


def test_smoke_suite_results_are_well_formed(tmp_path):
    # costs as if measured: timed ones, on a busy CPU, can keep the full-acceptance arm plain
    options = {"cost_model": fixed_costs()}
    path = run.main(["--suite", "smoke", "--out", str(tmp_path)], engine_options=options)
    doc = json.loads(path.read_text())
    assert doc["machine"]["backend"] == "cpu" and doc["machine"]["mlx"]
    assert doc["bandwidth_gbps"] > 0
    shape = doc["shapes"]["qwen3-tiny"]
    assert shape["physical_limit_tps"] > 0 and shape["target_gb"] > 0
    arms_seen = {
        (r["arm"], r.get("acceptance"), r.get("batch"), r["context"]) for r in doc["results"]
    }
    plan = doc["suite"]["plans"][0]
    for ctx in plan["contexts"]:
        assert ("mlx_lm.stream_generate", None, None, ctx) in arms_seen
        assert ("dflash.engine", "drafted=0.89", None, ctx) in arms_seen
        assert ("dflash.runner", "drafted=0.89", None, ctx) in arms_seen
        for b in plan["batches"]:
            assert ("mlx_lm.batch_generate", None, b, ctx) in arms_seen
    for r in doc["results"]:
        assert r["status"] == "ok", r
        f = r["figures"]
        if r["arm"] == "dflash.cycle-breakdown":
            assert f["verify_ms"] > 0 and f["draft_ms"] > 0
            continue
        assert f["decode_tps"] > 0 and f["prefill_tps"] > 0
        if r["arm"] != "dflash.runner":
            assert f["generated_tokens"] == doc["suite"]["max_tokens"]
            assert f["prompt_tokens"] == r["context"]
        if r["arm"] == "dflash.engine" and r["acceptance"] == "full":
            assert f["acceptance_drafted"] == 1.0
        if r["arm"] == "dflash.engine" and "=" in r["acceptance"]:
            assert f["script_matches_target"] is True
    report.main([str(path), "--page", ""])
    md = path.with_suffix(".md").read_text()
    assert "mlx_lm stream_generate" in md and "Physical limit" in md


def test_the_engine_copy_of_the_target_has_the_same_weights():
    from mlx.utils import tree_flatten

    setup = arms.build_setup("qwen3-tiny", mx.float32, with_ar_draft=False)
    copy = arms.engine_setup(setup)
    ours, theirs = (
        dict(tree_flatten(setup.model.parameters())),
        dict(tree_flatten(copy.model.parameters())),
    )
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def test_mlx_lm_arms_run_with_stock_ops_and_restore_the_engine_routing():
    from dflash_batch.engine.ops import attention, matmul, switch

    with switch.modes(attention="reference", matmul="kernel"):
        with arms.stock_ops():
            assert attention.mode() == "stock" and matmul.mode() == "stock"
        assert attention.mode() == "reference" and matmul.mode() == "kernel"
    with arms.stock_ops():
        pass
    assert attention.mode() == attention.default_mode() and matmul.mode() == matmul.default_mode()


def test_scripted_acceptance_on_an_untied_hybrid_target_uses_its_lm_head():
    """Qwen3.5-9B has an untied head under ``language_model``: the draft must be scored with it."""
    import copy

    from benchmarks import shapes

    shape = copy.deepcopy(shapes.SHAPES["qwen3.5-tiny"])
    shape.name = "qwen3.5-tiny-untied"
    shape.target["text_config"]["tie_word_embeddings"] = False
    shapes.SHAPES[shape.name] = shape
    try:
        setup = arms.build_setup(shape.name, mx.float32, with_ar_draft=False)
        engine = arms.make_engine(setup, setup.drafter, adaptive_block=False)
        script = AcceptanceScript.of_drafted(0.89, engine.block_size, seed=1)
        engine.drafter = arms.scripted_drafter(setup, script)
        with arms.zeroed_final_norm(setup.model):
            _, cycles = _verify_steps(engine, arms.prompt_ids(32, setup.vocab_size), 64)
        _check_cycles_follow_script(cycles, script.drawn)
    finally:
        del shapes.SHAPES[shape.name]


def test_runner_benchmark_arms_count_the_same_job(tmp_path):
    """benchmarks/runner.py: distinct prompts; the runner arm runs the whole job into a fresh
    output dir each time and counts its generated tokens (fake engine: max_tokens each)."""
    from benchmarks import runner as bench
    from tests.fake_engine import FakeEngine

    prompts = bench.job_prompts(5)
    assert len(set(prompts)) == 5
    first = bench.run_runner(FakeEngine(), prompts, 4, 2, tmp_path)
    again = bench.run_runner(FakeEngine(), prompts, 4, 2, tmp_path)
    assert first["tokens"] == again["tokens"] == 5 * 4 and first["wall_s"] > 0
    # --prompts-file: the README's job file, its prompts in order.
    # --prompts-file: the README's job file, its prompts in order (chat rows as messages, a
    # system field as a system turn), written back as job rows the runner reads.
    readme_job = bench.file_prompts(str(REPO / "examples" / "prompts.jsonl"))
    assert len(readme_job) == 8 and readme_job[0] == "Say hello to a new colleague in one sentence."
    assert isinstance(readme_job[3], list) and readme_job[6][0]["role"] == "system"
    chat = bench.run_runner(FakeEngine(), readme_job, 4, 2, tmp_path)
    assert chat["tokens"] == 8 * 4


def _zero_head_job(zero_head_target, model_dir, tmp_path, n: int):
    """A block-8 drafter over the zeroed-head target (every draft accepted), ``n`` held-out
    prompts as ids in ``tmp_path/eval.jsonl``, and the tokens per cycle a fixed-width engine
    makes on them (the prefill's token aside): (drafter folder, samples file, tau)."""
    from dflash_batch.engine import load_engine

    from tests import synthetic
    from tests.helpers import make_drafter

    draft = make_drafter(model_dir, "draft-b8", synthetic.tiny_qwen3_config(), block_size=8)
    prompts = [{"id": f"p{i}", "kind": "test", "prompt": [5 + i, 6, 7, 8]} for i in range(n)]
    samples = tmp_path / "eval.jsonl"
    samples.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    fixed = load_engine(str(zero_head_target), str(draft), adaptive_block=False)
    stats = [fixed.generate(p["prompt"], max_tokens=30).stats for p in prompts]
    return draft, samples, sum(s.generated_tokens - 1 for s in stats) / sum(s.cycles for s in stats)


def test_default_pair_acceptance_is_the_drafters_even_when_the_adaptive_width_stays_plain(
    zero_head_target, model_dir, tmp_path, monkeypatch, chain_drafts
):
    """benchmarks/default_pair.py reports the drafter's acceptance with the whole block verified
    every cycle. Here the adaptive width never drafts (as on the H100 of 2026-11-23, where a
    weak drafter's 1.08 tokens per cycle were mostly plain cycles): the acceptance figure must
    not change, and the adaptive engine's own tokens per cycle (1.0) are reported apart."""
    from dflash_batch.engine.widths import WidthPolicy

    from benchmarks import default_pair

    draft, samples, tau = _zero_head_job(zero_head_target, model_dir, tmp_path, 2)
    assert tau > 4  # zeroed head: every draft accepted

    plain_width = WidthPolicy.width
    monkeypatch.setattr(
        WidthPolicy,
        "width",
        lambda self, e, b, tail=None: plain_width(self, e, b, tail) if self.fixed else 1,
    )
    argv = ["--target", str(zero_head_target), "--draft", str(draft), "--samples", str(samples), "--prompts", "2",
            "--speed-prompts", "1", "--runs", "1", "--max-tokens", "30", "--machine", "t", "--out-dir", str(tmp_path)]  # fmt: skip
    assert default_pair.main(argv) == 0
    result = json.loads((tmp_path / "default-pair-t.json").read_text())
    assert result["mean_acceptance_length"] == round(tau, 3)
    assert result["adaptive_tokens_per_cycle"] == 1.0 and result["exact_prompts"] == 2


def test_batch_one_logs_every_cycle_of_the_adaptive_engine(zero_head_target, model_dir, tmp_path):
    """benchmarks/batch_one.py: each timed adaptive run's cycles commit its tokens after the
    prefill's first, and the summary counts every one of them; the whole-block arm is timed too."""
    from benchmarks import batch_one

    draft, samples, _ = _zero_head_job(zero_head_target, model_dir, tmp_path, 2)
    out = tmp_path / "b1.json"
    argv = ["--target", str(zero_head_target), "--draft", str(draft), "--samples", str(samples), "--prompts", "2",
            "--max-tokens", "30", "--runs", "2", "--out", str(out)]  # fmt: skip
    assert batch_one.main(argv) == 0
    result = json.loads(out.read_text())
    for i, row in enumerate(result["prompts"]):
        for run in (-1, 0, 1):
            cycles = [c for c in result["cycles"] if c["prompt"] == i and c["run"] == run]
            assert sum(c["committed"] for c in cycles) == row["tokens"] - 1
        assert row["whole_block"] > 0 and row["no_draft"] > 0
    timed = [c for c in result["cycles"] if c["run"] >= 0]
    assert sum(w["cycles"] for w in result["adaptive_widths"].values()) == len(timed)
    assert result["cost_model"]["timed_ms"]


def test_verify_ops_counts_each_modes_graph(tiny_pair, tmp_path):
    """benchmarks/verify_ops.py: per mode and width, the verify pass's operations and time; the
    MLX-ops reference attention of a multi-row pass has more operations than stock SDPA's (the
    mode must take effect), and a one-row pass is not routed (the same graph in both); compiled
    passes (engine/ops/compiled.py) fuse the multi-row pass into fewer operations, the drafter's too."""
    from benchmarks import verify_ops

    target, drafter = tiny_pair
    out = tmp_path / "ops.json"
    argv = [
        "--target",
        str(target),
        "--draft",
        str(drafter),
        "--widths",
        "1,4",
        "--modes",
        "stock,reference",
        "--context",
        "40",
        "--out",
        str(out),
    ]
    assert verify_ops.main(argv) == 0
    passes = json.loads(out.read_text())["passes"]
    ops = {(p["passes"], p["mode"], p["T"]): p["ops"] for p in passes if p["pass"] == "verify"}
    for way in ("eager", "compiled"):
        assert (
            ops[way, "reference", 4] > ops[way, "stock", 4]
            and ops[way, "reference", 1] == ops[way, "stock", 1] > 0
        )
    assert ops["compiled", "stock", 4] < ops["eager", "stock", 4]
    assert ops["compiled", "stock", 1] == ops["eager", "stock", 1]  # a plain step stays eager
    drafts = {(p["passes"], p["mode"]): p for p in passes if p["pass"] == "draft"}
    for mode in ("stock", "reference"):
        assert (
            drafts["compiled", mode]["ops"] < drafts["eager", mode]["ops"]
            and drafts["compiled", mode]["ms"] > 0
        )


def test_small_matmul_ways_compute_the_same_product(tmp_path):
    """benchmarks/small_matmul.py: both ways give ``x @ W.T`` (the one-row batches keep each row
    apart), timed per row count."""
    from benchmarks import small_matmul

    out = tmp_path / "sm.json"
    assert small_matmul.main(["--rows", "1,3", "--outputs", "40", "--inputs", "32", "--chain", "2", "--reps", "1",
                              "--out", str(out)]) == 0  # fmt: skip
    products = json.loads(out.read_text())["products"]
    assert [p["M"] for p in products] == [1, 3]
    assert all(
        p["gemv_max_abs_diff"] < 1e-5 and p["matmul_max_abs_diff"] == 0 and p["gemv_us"] > 0
        for p in products
    )


def test_held_out_acceptance_counts_the_drafters_tokens_per_cycle_in_batches(
    zero_head_target, model_dir, tmp_path, chain_drafts
):
    """benchmarks/held_out_acceptance.py: tokens per cycle over batched rows, whole block verified,
    outputs checked against plain decoding. A zeroed head accepts every draft, so each cycle
    commits the block (less where a row's budget ends inside it)."""
    from benchmarks import held_out_acceptance

    draft, samples, tau = _zero_head_job(zero_head_target, model_dir, tmp_path, 3)
    out = tmp_path / "acc.json"
    argv = ["--target", str(zero_head_target), "--draft", str(draft), "--samples", str(samples), "--prompts", "3",
            "--max-tokens", "30", "--batch", "2", "--out", str(out)]  # fmt: skip
    assert held_out_acceptance.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 3 and result["exact_prompts"] == 3
    assert result["tokens_per_cycle"] == round(tau, 3) and tau > 4


def test_draft_vocab_benchmark_rebuilds_each_size_from_the_answers(
    zero_head_target, model_dir, tmp_path, chain_drafts
):
    """benchmarks/draft_vocab.py: each size's vocabulary is the most written tokens of the data's
    training answers. Over the zeroed-head target every draft is token 0: a vocabulary without it
    accepts nothing (1 token per cycle), one with it accepts as the whole vocabulary does, and
    outputs never change."""
    from benchmarks import draft_vocab
    from dflash_batch.training.store import AnswerStore, prompt_key

    draft, samples, tau = _zero_head_job(zero_head_target, model_dir, tmp_path, 2)
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"vocab_size": 512, "eos_token_ids": [3]}))
    rows = [
        {"id": f"t{i}", "kind": "test", "split": "train", "prompt": [20 + i, 21]} for i in range(3)
    ]
    for r in rows:
        r["key"] = prompt_key(r["prompt"])
    (data / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with AnswerStore(data / "answers", 512).open_writer() as w:
        for i, r in enumerate(rows):  # tokens 10..17 five times each, token 0 three times in all
            w.append(
                r["key"],
                0,
                list(range(10, 18)) * 5 + [0] * (i == 0) * 3,
                ended=False,
                temperature=0.0,
            )
    out = tmp_path / "vocab.json"
    argv = ["--target", str(zero_head_target), "--draft", str(draft), "--data", str(data), "--sizes", "4,16",
            "--samples", str(samples), "--prompts", "2", "--speed-prompts", "1", "--max-tokens", "30",
            "--speed-max-tokens", "12", "--out", str(out)]  # fmt: skip
    assert draft_vocab.main(argv) == 0
    result = json.loads(out.read_text())
    by_size = {r["size"]: r for r in result["sizes"]}
    assert sorted(by_size) == [0, 4, 16] and result["training_answers"] == 3
    assert (
        by_size[0]["tokens_per_cycle"] == round(tau, 3) == by_size[16]["tokens_per_cycle"]
        and tau > 4
    )
    assert by_size[4]["tokens_per_cycle"] == 1.0  # {3, 10, 11, 12}: token 0 is never drafted
    assert all(r["same_output_prompts"] == 2 and r["decode_tps"] > 0 for r in result["sizes"])
    assert by_size[16]["coverage"] == 1.0 and by_size[4]["coverage"] == round(
        45 / 123, 5
    )  # 10, 11, 12: 15 each of 123


def test_anchor_bias_chains_the_objective_as_decoding_moves(
    zero_head_target, model_dir, tmp_path, chain_drafts
):
    """benchmarks/anchor_bias.py: the objective's acceptance chained through the anchors decoding
    reaches equals the engine's real tokens per cycle; at every anchor with a whole block after
    it, the zeroed head accepts the whole block (8)."""
    from benchmarks import anchor_bias

    draft, samples, tau = _zero_head_job(zero_head_target, model_dir, tmp_path, 2)
    out = tmp_path / "bias.json"
    argv = ["--target", str(zero_head_target), "--draft", str(draft), "--samples", str(samples), "--prompts", "2",
            "--max-tokens", "30", "--out", str(out)]  # fmt: skip
    assert anchor_bias.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["real_tokens_per_cycle"] == result["chained_tokens_per_cycle"] == round(tau, 3)
    assert result["real_cycles"] == result["chained_cycles"] > 0
    assert result["uniform_anchor_tokens_per_cycle"] == 8.0


def test_cycle_pieces_counts_each_cycles_passes_once(
    zero_head_target, model_dir, tmp_path, chain_drafts
):
    """benchmarks/cycle_pieces.py: one verify pass per cycle and at most one draft, none from the
    warm-up's timed passes (a first version counted those and its pieces summed past the cycle)."""
    from benchmarks import cycle_pieces

    draft, samples, _ = _zero_head_job(zero_head_target, model_dir, tmp_path, 1)
    # a second prompt of another context bucket: the engine warms up again inside the timed run
    samples.write_text(
        samples.read_text()
        + json.dumps({"id": "long", "kind": "test", "prompt": list(range(5, 205))})
        + "\n"
    )
    out = tmp_path / "pieces.json"
    result = cycle_pieces.main(["--target", str(zero_head_target), "--draft", str(draft), "--samples", str(samples),
                                "--prompts", "2", "--max-tokens", "30", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == result
    passes = sum(n for n, _ in result["verify_ms_per_pass"].values())
    assert result["cycles"] > 0 and passes == result["cycles"]
    assert result["ms_per_cycle"]["rest"] >= 0 and result["step_ms"] > 0


def test_cpu_ops_benchmark_times_both_arms_of_every_measure(qwen3_target, tmp_path):
    """benchmarks/cpu_ops.py: every measure has both arms, and the ops' outputs are MLX's."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("the CPU ops are built for Linux")
    from benchmarks import cpu_ops

    out = tmp_path / "cpu-ops.json"
    result = cpu_ops.main(
        [
            "--target",
            str(qwen3_target),
            "--context",
            "40",
            "--widths",
            "1,4",
            "--prefill",
            "48",
            "--reps",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["command"].startswith("python -m benchmarks.cpu_ops")
    arms = list(result["ops"].values()) + list(result["verify"].values())
    assert len(arms) == 5 and all(
        a["identical"] and a["native_ms"] > 0 and a["mlx_ms"] > 0 for a in arms
    )
    assert (
        result["prefill"]["tokens"] == 48
        and min(result["prefill"][k] for k in ("native_s", "mlx_s", "mlx_lm_s")) > 0
    )


def test_warm_up_breakdown_records_each_step_and_puts_the_engine_back(tmp_path, monkeypatch):
    from dflash_batch.engine import batch, warmup

    from benchmarks import warm_up_breakdown

    monkeypatch.setenv("DFLASH_BATCH_CACHE", str(tmp_path / "cache"))
    run, run_once = batch.BatchDecoder.run, warmup._run_once
    out = tmp_path / "breakdown.json"
    assert warm_up_breakdown.main(["--smoke", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["prepare"]["read"] is False and figures["prepare_passes"]
    # passes timed at batch 1 and at the job's batch size (engine/warmup.py)
    labels = {label for label, _ in figures["prepare_passes"]}
    assert {"t B2 T1", "d B2"} <= labels and all(
        label[:4] in ("t B1", "t B2", "d B1", "d B2") for label in labels
    )
    assert len(figures["jobs"]) == 2
    for job in figures["jobs"]:
        cycles = {k: v for k, v in job["steps"].items() if k.startswith("cycle B2 T")}
        assert cycles and all(count >= 1 and total > 0 for count, total, _ in cycles.values())
    assert batch.BatchDecoder.run is run and warmup._run_once is run_once


def test_prefill_joins_times_every_arm_of_both_parts(tmp_path, monkeypatch):
    """benchmarks/prefill_joins.py --smoke (the embedded default pair): the taps part prefills
    one group by each engine, the joins part runs the job in four arms, and gathering is put
    back after the arms that turned it off."""
    from dflash_batch.engine import batch

    from benchmarks import prefill_joins

    real = batch.BatchDecoder._gather
    out = tmp_path / "joins.json"
    doc = prefill_joins.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert set(doc["taps"]) == {"drafter", "plain"}
    assert all(r["passes"] >= 1 and r["seconds"] > 0 for r in doc["taps"].values())
    arms = {"drafter", "drafter gathered", "plain", "plain gathered"}
    assert set(doc["joins"]) == arms
    assert all(r["passes"] >= 1 and r["cycles"] for r in doc["joins"].values())
    assert batch.BatchDecoder._gather is real
