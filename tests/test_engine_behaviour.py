"""Engine behaviour: statistics, stops inside accepted blocks, errors, capture, drafter context."""

from __future__ import annotations

import json
import shutil

from dflash_batch.engine import decode, load_drafter, load_engine, resolve_model_path
from dflash_batch.engine.models.drafter import ModelArgs, build_target_layer_ids
from dflash_batch.engine.models.target import Target
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load

from dflash_batch.completion import (
    EmptyPromptError,
    GenerationError,
    ModelMismatchError,
    PromptTooLongError,
)
from tests import synthetic
from tests.helpers import fixed_costs, greedy_reference, make_drafter, set_modes
from tests.scripting import ScriptedDrafts


@pytest.fixture(scope="module")
def full_accept(zero_head_target, model_dir):
    """Zeroed head: target and drafter both always pick token 0, so every block is accepted.
    Every cycle verifies the whole block (no width policy), so the cycle structure is known. (Tests
    that use it verify chains: a tree over a drafter that finds every token equally likely
    branches at its first position.)"""
    draft = make_drafter(model_dir, "draft-b8", synthetic.tiny_qwen3_config(), block_size=8)
    return load_engine(str(zero_head_target), str(draft), adaptive_block=False)


def test_full_block_acceptance_statistics(full_accept, monkeypatch):
    set_modes(monkeypatch, full_accept, drafts="chain")
    c = full_accept.generate("Hello", max_tokens=50)
    s = c.stats
    assert c.token_ids == [0] * 50 and c.finish_reason == "length"
    # 1 token from prefill, then 6 cycles of 8 (49 so far), then a last cycle clipped to 1.
    assert s.generated_tokens == 50
    assert s.cycles == 7
    assert s.acceptance_histogram == [0, 1, 0, 0, 0, 0, 0, 0, 6]
    assert s.drafted_tokens == 6 * 7
    assert s.accepted_tokens == 6 * 7
    assert s.tokens_per_cycle == 7.0
    assert s.acceptance_drafted == 1.0
    assert s.acceptance_generated == 42 / 50
    assert s.block_size == 8 and s.prompt_tokens > 0


def test_block_size_option_caps_verify_rows(zero_head_target, model_dir, chain_drafts):
    draft = make_drafter(model_dir, "draft-b8", synthetic.tiny_qwen3_config(), block_size=8)
    engine = load_engine(str(zero_head_target), str(draft), block_size=4, adaptive_block=False)
    s = engine.generate("Hello", max_tokens=17).stats  # 1 + 4 x 4
    assert s.acceptance_histogram == [0, 0, 0, 0, 4] and s.cycles == 4


def test_the_drafters_acceptance_carries_from_job_to_job(zero_head_target, model_dir, chain_drafts):
    """Every job's width policy pools its rows' cycles into the engine's estimates, and the next job
    starts from them (at batch 1 each request is a job of its own). Chains: a zeroed head's drafts
    are all accepted only as a chain drafts them (its argmax, token 0); a tree's candidates over
    equal logits need not hold token 0."""
    draft = make_drafter(model_dir, "draft-b8", synthetic.tiny_qwen3_config(), block_size=8)
    # given costs: it drafts on a busy CPU too
    engine = load_engine(str(zero_head_target), str(draft), cost_model=fixed_costs())
    first = engine._width_policy(1)
    assert first.job is engine.acceptance and engine.acceptance.seen[0] == 0
    engine.generate([5, 6, 7, 8], max_tokens=60)
    assert (
        engine.acceptance.seen[0] > 0 and engine.acceptance.probabilities()[0] > 0.9
    )  # every draft accepted
    assert engine._width_policy(1).job is engine.acceptance


def test_what_widths_cost_carries_across_warm_ups(zero_head_target, model_dir):
    """A width's learnt cost (``CostModel.width_excess``: a BLAS's quirk at 12 rows, say) is the
    shape's, not the context's: a job at another context, which warms the engine up again,
    keeps it."""
    draft = make_drafter(model_dir, "draft-b8", synthetic.tiny_qwen3_config(), block_size=8)
    engine = load_engine(str(zero_head_target), str(draft))
    short = engine._width_policy(1, [engine.request([5, 6, 7, 8], max_tokens=8)]).cost
    for _ in range(3):
        short.observe(1, 6, short.passes(1, 6) + 1.0)
    long = engine._width_policy(
        1, [engine.request([5 + i % 500 for i in range(600)], max_tokens=400)]
    ).cost
    assert long is not short and long.context != short.context  # warmed up again
    assert long.cycle(1, 6) == pytest.approx(long.passes(1, 6) + 1.0)


def test_eos_inside_accepted_block_cuts_there(full_accept):
    engine = full_accept
    eos = set(engine.tokenizer.eos_token_ids)
    engine.tokenizer.eos_token_ids = {0}
    try:
        c = engine.generate("Hello", max_tokens=50)
    finally:
        engine.tokenizer.eos_token_ids = eos
    # The prefill already emits token 0, the EOS: nothing is output, reason "stop".
    assert c.token_ids == [] and c.finish_reason == "stop" and c.stop_reason == "eos"


def test_eos_and_stop_string_mid_block(tiny_pair, monkeypatch, chain_drafts):
    target, draft = tiny_pair
    engine = load_engine(
        str(target), str(draft), adaptive_block=False
    )  # whole blocks: cuts fall inside them
    ids = engine.encode("Write a haiku about the sea.")
    ref = greedy_reference(target, ids, 60, engine.tokenizer.eos_token_ids)
    ScriptedDrafts(monkeypatch)(
        ids + ref + [0] * 16, p_wrong=0.0
    )  # the true continuation: full blocks
    # EOS: the first token (after the first block) that did not occur earlier.
    k = next(i for i in range(20, len(ref)) if ref[i] not in ref[:i])
    eos = set(engine.tokenizer.eos_token_ids)
    engine.tokenizer.eos_token_ids = {ref[k]}
    try:
        c = engine.generate(ids, max_tokens=60)
    finally:
        engine.tokenizer.eos_token_ids = eos
    assert c.token_ids == ref[:k] and c.finish_reason == "stop" and c.stop_reason == "eos"
    assert c.stats.generated_tokens == k + 1
    assert (
        max(i for i, n in enumerate(c.stats.acceptance_histogram) if n) == 16
    )  # cut inside a full block

    # max_tokens not a multiple of the block: cut inside the block budget.
    c = engine.generate(ids, max_tokens=23)
    assert c.token_ids == ref[:23] and c.finish_reason == "length"

    # A stop string that ends inside an accepted block: text cut before it.
    full_text = engine.generate(ids, max_tokens=60).text
    assert full_text == engine.tokenizer.decode(ref)
    mid = len(full_text) // 2
    stop = next(
        full_text[i : i + 3]
        for i in range(mid, len(full_text))
        if full_text.find(full_text[i : i + 3]) == i
    )
    c = engine.generate(ids, max_tokens=60, stop=[stop])
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert stop not in c.text and full_text.startswith(c.text)
    assert c.text == full_text[: full_text.find(stop)]


def test_stream_pieces_join_to_generate(tiny_pair):
    engine = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    pieces = list(engine.stream("Tell me a story", max_tokens=30, stop=["zz"]))
    c = engine.generate("Tell me a story", max_tokens=30, stop=["zz"])
    assert "".join(p.text for p in pieces) == c.text
    assert [t for p in pieces for t in p.token_ids] == c.token_ids
    assert pieces[-1].stats is not None and all(p.stats is None for p in pieces[:-1])


def test_ar_fallback_without_drafter(tiny_pair):
    target, _ = tiny_pair
    engine = load_engine(str(target), None)
    assert engine.drafter is None and engine.block_size == 0
    ids = engine.encode("Hello there")
    c = engine.generate(ids, max_tokens=20)
    assert c.token_ids == greedy_reference(target, ids, 20, engine.tokenizer.eos_token_ids)
    assert c.stats.cycles == c.stats.generated_tokens - 1 and c.stats.drafted_tokens == 0


def test_sampling_is_seeded(tiny_pair):
    engine = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    a = engine.generate("Hi", max_tokens=20, temperature=0.8, seed=3).token_ids
    b = engine.generate("Hi", max_tokens=20, temperature=0.8, seed=3).token_ids
    assert a == b and len(a) > 0


def test_bad_prompts_get_clear_errors(tiny_pair):
    engine = load_engine(str(tiny_pair[0]), str(tiny_pair[1]), max_context=64)
    with pytest.raises(EmptyPromptError):
        engine.generate("   ")
    with pytest.raises(EmptyPromptError):
        engine.generate([])
    with pytest.raises(PromptTooLongError, match="64"):
        engine.generate(list(range(10, 80)))
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.generate([5, 10**6])
    with pytest.raises(GenerationError, match=r"messages\[0\]\.content must be a string"):
        engine.generate([{"role": "user"}])
    with pytest.raises(GenerationError, match="max_tokens"):
        engine.generate("Hi", max_tokens=0)
    # Generation stops at the context limit instead of running past it.
    c = engine.generate(list(range(10, 60)), max_tokens=100)
    assert c.finish_reason == "stop" or len(c.token_ids) <= 14


def test_drafter_that_does_not_fit(qwen3_target, model_dir):
    wide = synthetic.tiny_qwen3_config(hidden=64)
    with pytest.raises(ModelMismatchError, match="hidden size"):
        load_engine(str(qwen3_target), str(make_drafter(model_dir, "draft-wide", wide)))
    deep = dict(synthetic.tiny_qwen3_config(), num_hidden_layers=12)
    too_deep = make_drafter(model_dir, "draft-deep", deep, target_layer_ids=[1, 10])
    with pytest.raises(ModelMismatchError, match="layers"):
        load_engine(str(qwen3_target), str(too_deep))


def test_capture_is_bit_identical_to_model_call(qwen3_target, llama_target):
    for folder in (qwen3_target, llama_target):
        model, _ = mlx_load(str(folder))
        tokens = mx.array([[5, 9, 100, 7, 42, 3]])
        expected = model(tokens)
        target = Target(model, tap_ids=[0, 2, 3])
        logits, hidden = target(tokens, target.make_cache(Lengths([0])))
        assert mx.array_equal(logits, expected)
        assert hidden.shape == (1, 6, 3 * target.hidden_size)


def test_drafter_context_is_the_committed_tapped_hidden_state(tiny_pair, monkeypatch, chain_drafts):
    """Context rows handed to the drafter, cycle by cycle, equal the tapped hidden states of
    one fresh target pass over prompt + committed tokens."""
    target_dir, draft_dir = tiny_pair
    # given costs: no warm-up passes among the job's, and drafting cycles on a busy CPU too
    engine = load_engine(str(target_dir), str(draft_dir), cost_model=fixed_costs())
    seen = []  # context rows as the drafter receives them: the prompt's, then each cycle's new ones
    add_context = engine.drafter.add_context
    real = decode.draft_block

    def prompt_context(context, cache):
        seen.append(context)
        return add_context(context, cache)

    def spy(drafter, target, last, context, counts, cache, rows, **kw):
        assert counts is None  # one row: every context row it brings is valid
        seen.append(context)
        return real(drafter, target, last, context, counts, cache, rows, **kw)

    monkeypatch.setattr(engine.drafter, "add_context", prompt_context)
    monkeypatch.setattr(decode, "draft_block", spy)
    ids = engine.encode("Count: one two three four")
    c = engine.generate(ids, max_tokens=30)
    context = mx.concatenate(seen, axis=1)
    full = ids + c.token_ids
    n = context.shape[1]
    lengths = Lengths([0])
    _, hidden = engine.target(mx.array([full[:n]]), engine.target.make_cache(lengths))
    assert len(ids) < n <= len(full)
    assert mx.allclose(context, hidden, atol=1e-4).item()


def test_drafter_config_styles_and_errors(tmp_path):
    base = synthetic.drafter_config(synthetic.tiny_qwen3_config(), block_size=8)
    flat = ModelArgs.from_config(base)
    nested = ModelArgs.from_config(
        synthetic.drafter_config(synthetic.tiny_qwen3_config(), block_size=8, nested=True)
    )
    assert (flat.block_size, flat.mask_token_id, flat.target_layer_ids) == (
        nested.block_size,
        nested.mask_token_id,
        nested.target_layer_ids,
    )
    assert nested.rope_theta == 1e6
    for key in ("hidden_size", "num_hidden_layers", "rms_norm_eps"):
        broken = {k: v for k, v in base.items() if k != key}
        with pytest.raises(KeyError, match=key):
            ModelArgs.from_config(broken)
    no_mask = {k: v for k, v in base.items() if k != "mask_token_id"}
    with pytest.raises(KeyError, match="mask_token_id"):
        ModelArgs.from_config(no_mask)
    fallback = {k: v for k, v in base.items() if k != "target_layer_ids"}
    assert (
        ModelArgs.from_config(fallback).target_layer_ids == build_target_layer_ids(4, 2) == [1, 1]
    )
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-4B taps
    extra = dict(base, some_future_key=1, dflash_config={"unknown": 2})
    assert ModelArgs.from_config(extra).block_size == 8
    sliding = ModelArgs.from_config(
        synthetic.drafter_config(synthetic.tiny_qwen3_config(), layers=3, sliding_window=16)
    )
    assert sliding.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]


def test_sliding_drafter_runs_lossless(qwen3_target, model_dir):
    draft = make_drafter(
        model_dir, "draft-swa", synthetic.tiny_qwen3_config(), layers=3, sliding_window=8
    )
    engine = load_engine(str(qwen3_target), str(draft))
    ids = engine.encode("A sliding window drafter " * 4)
    assert engine.generate(ids, max_tokens=40).token_ids == greedy_reference(
        qwen3_target, ids, 40, engine.tokenizer.eos_token_ids
    )


def test_hub_repo_ids_resolve_through_the_hub_cache(tmp_path, qwen3_drafter, monkeypatch):
    """A repo id at a pinned revision loads through huggingface_hub, from its cache layout."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = cache / "models--z-lab--Tiny-DFlash" / "snapshots" / commit
    shutil.copytree(qwen3_drafter, snap)
    (cache / "models--z-lab--Tiny-DFlash" / "refs").mkdir()
    (cache / "models--z-lab--Tiny-DFlash" / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    assert resolve_model_path("z-lab/Tiny-DFlash", revision=commit) == snap
    assert resolve_model_path("z-lab/Tiny-DFlash") == snap
    drafter = load_drafter("z-lab/Tiny-DFlash", revision=commit)
    assert drafter.args.block_size == 16
    with pytest.raises(FileNotFoundError, match="z-lab/Missing"):
        resolve_model_path("z-lab/Missing")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path("./no/such/folder")


def test_quantized_drafter_loads(tmp_path, qwen3_drafter, qwen3_target):
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    drafter = load_drafter(qwen3_drafter)
    nn.quantize(drafter, group_size=32, bits=8)
    mx.save_safetensors(
        str(tmp_path / "model.safetensors"), dict(tree_flatten(drafter.parameters()))
    )
    cfg = json.loads((qwen3_drafter / "config.json").read_text())
    cfg["quantization"] = {"group_size": 32, "bits": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = load_engine(str(qwen3_target), str(tmp_path))
    ids = engine.encode("Quantized drafter")
    assert engine.generate(ids, max_tokens=20).token_ids == greedy_reference(
        qwen3_target, ids, 20, engine.tokenizer.eos_token_ids
    )


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_target_lm_head_is_the_models_own_untied_head(tmp_path, kind):
    """The drafter scores its proposals with the target's real head (untied heads included)."""
    if kind == "llama":
        cfg = synthetic.tiny_llama_config()
    else:
        cfg = dict(synthetic.tiny_qwen3_5_config(), tie_word_embeddings=False)
    model, _ = mlx_load(str(synthetic.save_target(tmp_path / kind, cfg, seed=4)))
    inner = (getattr(model, "language_model", None) or model).model
    target = Target(model, tap_ids=[len(inner.layers) - 1])  # tap the last layer: pre-norm output
    logits, hidden = target(mx.array([[5, 9, 100, 7]]), target.make_cache(Lengths([0])))
    assert mx.allclose(target.lm_head(inner.norm(hidden)), logits, atol=1e-5).item()
    assert not mx.allclose(
        target.embed_tokens.as_linear(inner.norm(hidden)), logits, atol=1e-3
    ).item()


def test_prefill_sizes_default_by_backend_and_refuse_zero(tiny_pair):
    """A CPU prefills in chunks of 512 tokens and packed passes of at most 4,096 (a GPU: 2,048 and
    8,192; engine/memory.py: default_prefill); explicit sizes are kept; a chunk of 0 is refused."""
    from dflash_batch.engine import memory

    engine = load_engine(str(tiny_pair[0]), draft=None)
    assert (engine.prefill_chunk, engine.prefill_tokens) == memory.default_prefill()
    if mx.default_device() == mx.cpu:
        assert memory.default_prefill() == (512, 4096)
    engine = load_engine(str(tiny_pair[0]), draft=None, prefill_chunk=64, prefill_tokens=96)
    assert (engine.prefill_chunk, engine.prefill_tokens) == (64, 96)
    with pytest.raises(ValueError, match="prefill_chunk"):
        load_engine(str(tiny_pair[0]), draft=None, prefill_chunk=0)
