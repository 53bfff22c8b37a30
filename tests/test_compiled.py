"""Compiled decoding passes (engine/compiled.py): traced once per shape, replayed after, and every
row's output still the target's own greedy output (fp32, CPU), whatever the other rows are."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_batch.engine import compiled, load_engine, routing
from dflash_batch.engine.batch_cache import Lengths
from tests import synthetic
from tests.conftest import make_drafter
from tests.test_batched import MAX_TOKENS, PROMPTS_B, scripted_batch


@pytest.fixture
def passes_compiled():
    with routing.modes(passes="compiled"):
        yield


def test_capacity_follows_the_ladder_only_when_passes_compile():
    with routing.modes(passes="compiled"):
        assert compiled.capacity(1, 300) == 512
        assert compiled.capacity(4, 512) == 512
        assert compiled.capacity(2, 1500) == 2048
        assert compiled.capacity(1, 5000) == 5000  # beyond the ladder: eager, as allocated
        assert compiled.capacity(compiled.MAX_ROWS + 1, 300) == 300
    with routing.modes(passes="eager"):
        assert compiled.capacity(1, 300) == 300


def test_a_compiled_pass_equals_the_eager_pass_on_ragged_rows(tiny_pair):
    """Logits, tapped states and the K/V written, row by row, for rows of different lengths."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    lengths = [5, 17, 3]
    tokens = mx.array([[(11 * b + 3 * i) % 400 + 1 for i in range(4)] for b in range(3)], dtype=mx.int32)

    def fresh():
        cache = target.make_cache(Lengths(lengths), 512)
        for c in cache:  # rows of made-up keys, as a prefill leaves them
            c.keys, c.values = (mx.random.normal((3, kv_heads(target), 512, head_dim(target)), key=mx.random.key(k))
                                for k in (1, 2))
        return cache

    with routing.modes(passes="eager"):
        eager_cache = fresh()
        want_logits, want_hidden = target.decode_pass(tokens, eager_cache)
    with routing.modes(passes="compiled"):
        runs = []
        for _ in range(3):  # the first eagerly through the view, then a trace, then a replay
            cache = fresh()
            runs.append((*target.decode_pass(tokens, cache), cache))
    assert target.passes.calls["compiled"] >= 2
    for logits, hidden, cache in runs:
        assert mx.allclose(logits, want_logits, atol=1e-5).item()
        assert mx.allclose(hidden, want_hidden, atol=1e-5).item()
        for c, e in zip(cache, eager_cache):
            for b, n in enumerate(lengths):  # what each row holds up to its new length, and no more written
                assert mx.allclose(c.keys[b, :, : n + 4], e.keys[b, :, : n + 4], atol=1e-5).item()
                assert mx.array_equal(c.keys[b, :, n + 4 :], fresh_keys(c, b, n + 4)).item()


def kv_heads(target) -> int:
    return target.layers[0].self_attn.n_kv_heads


def head_dim(target) -> int:
    return target.layers[0].self_attn.k_proj.weight.shape[0] // kv_heads(target)


def fresh_keys(cache, b: int, start: int) -> mx.array:
    return mx.random.normal(cache.keys.shape, key=mx.random.key(1))[b, :, start:]


def test_dflash_is_lossless_with_compiled_passes(tiny_pair, passes_compiled):
    synthetic.assert_dflash_lossless(*tiny_pair)


@pytest.mark.parametrize("batch_size,target_kind", [(1, "qwen3"), (3, "qwen3"), (3, "qwen3_5")])
def test_batched_rows_equal_greedy_with_compiled_passes(qwen3_target, model_dir, monkeypatch, passes_compiled,
                                                        batch_size, target_kind):
    """Every acceptance length, EOS and budgets cut inside a block, rows joining and leaving: each
    row equals the target's greedy output; the passes were replayed, not rebuilt each cycle (a
    GatedDeltaNet target's stay eager: its tape)."""
    if target_kind == "qwen3":
        target, config = qwen3_target, synthetic.tiny_qwen3_config()
    else:
        config = synthetic.tiny_qwen3_5_config(layers=8)
        target = synthetic.save_target(model_dir / "q35-compiled", config, seed=1)
    drafter = make_drafter(model_dir, f"d-{target_kind}-8", config, block_size=8)
    engine, _, ids, refs = scripted_batch(target, drafter, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=False)
    before = dict(engine.target.passes.calls)
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
    for n, (c, ref) in enumerate(zip(batched, refs)):
        assert c.token_ids == ref, f"row {n}"
    calls = {k: engine.target.passes.calls[k] - before[k] for k in before}
    if target_kind == "qwen3_5":
        assert calls["compiled"] == 0
    else:
        assert calls["compiled"] > 3 * engine.target.passes.traced, calls  # mostly replays


def test_a_change_of_routing_traces_again(tiny_pair, passes_compiled):
    """A trace holds the routing chosen while tracing: another routing gets its own."""
    engine = load_engine(*map(str, tiny_pair))
    want = [c.token_ids for c in engine.generate_batch(synthetic.LOSSLESS_PROMPTS, max_tokens=24, batch_size=1)]
    with routing.modes(attention="reference"):
        got = [c.token_ids for c in engine.generate_batch(synthetic.LOSSLESS_PROMPTS, max_tokens=24, batch_size=1)]
    assert got == want
    assert len(engine.target.passes._compiled) == 2


def test_passes_stay_eager_where_they_cannot_compile(tiny_pair, passes_compiled, monkeypatch):
    """Off the ladder, wider than MAX_ROWS, past the buffer or one row: the eager pass."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    tokens = mx.array([[1, 2]], dtype=mx.int32)
    off_ladder = target.make_cache(Lengths([3]), 768)
    target.verify(tokens, off_ladder)  # allocates 768 columns
    assert not target.passes.applies(off_ladder, 2)
    monkeypatch.setattr(compiled, "MAX_ROWS", 0)
    on_ladder = target.make_cache(Lengths([3]), 512)
    target.verify(tokens, on_ladder)
    assert not target.passes.applies(on_ladder, 2)
    monkeypatch.setattr(compiled, "MAX_ROWS", 8)
    assert target.passes.applies(on_ladder, 2)
    assert not target.passes.applies(on_ladder, 512)  # the pass would write past the buffer
    assert not target.passes.applies(on_ladder, 1)  # a plain step
