"""Compiled decoding passes (engine/ops/compiled.py): traced once per shape, replayed after, and every
row's output still the target's own greedy output (fp32, CPU), whatever the other rows are. The
target's verify pass and the drafter's pass both."""

from __future__ import annotations

from dflash_batch.engine import decode, load_engine
from dflash_batch.engine.ops import compiled, switch
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx
import pytest

from tests import synthetic
from tests.helpers import (
    MAX_TOKENS,
    PROMPTS_B,
    eager_and_compiled_drafts,
    engine_modes,
    make_drafter,
    scripted_batch,
)


@pytest.fixture
def passes_compiled(monkeypatch):
    """Passes compile in the test: in engines made in it (their default), and passes run alone."""
    with switch.modes(passes="compiled"):  # first: the defaults resolve without the variable
        monkeypatch.setenv(compiled.ENV, "compiled")
        yield


def test_capacity_follows_the_ladder_only_when_passes_compile():
    with switch.modes(passes="compiled"):
        assert compiled.capacity(1, 300) == 512
        assert compiled.capacity(4, 512) == 512
        assert compiled.capacity(2, 1500) == 2048
        assert compiled.capacity(1, 5000) == 5000  # beyond the ladder: eager, as allocated
        assert compiled.capacity(compiled.MAX_ROWS + 1, 300) == 300
    with switch.modes(passes="eager"):
        assert compiled.capacity(1, 300) == 300


def test_a_compiled_pass_equals_the_eager_pass_on_ragged_rows(tiny_pair):
    """Logits, tapped states and the K/V written, row by row, for rows of different lengths."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    lengths = [5, 17, 3]
    tokens = mx.array(
        [[(11 * b + 3 * i) % 400 + 1 for i in range(4)] for b in range(3)], dtype=mx.int32
    )

    def fresh():
        cache = target.make_cache(Lengths(lengths), 512)
        for c in cache:  # rows of made-up keys, as a prefill leaves them
            c.keys, c.values = (
                mx.random.normal((3, kv_heads(target), 512, head_dim(target)), key=mx.random.key(k))
                for k in (1, 2)
            )
        return cache

    with switch.modes(passes="eager"):
        eager_cache = fresh()
        want_logits, want_hidden = target.decode_pass(tokens, eager_cache)
    with switch.modes(passes="compiled"):
        runs = []
        for _ in range(3):  # the first eagerly through the view, then a trace, then a replay
            cache = fresh()
            runs.append((*target.decode_pass(tokens, cache), cache))
    assert target.passes.calls["compiled"] >= 2
    for logits, hidden, cache in runs:
        assert mx.allclose(logits, want_logits, atol=1e-5).item()
        assert mx.allclose(hidden, want_hidden, atol=1e-5).item()
        for c, e in zip(cache, eager_cache):
            for b, n in enumerate(
                lengths
            ):  # what each row holds up to its new length, and no more written
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
def test_batched_rows_equal_greedy_with_compiled_passes(
    qwen3_target, model_dir, monkeypatch, passes_compiled, batch_size, target_kind, chain_drafts
):
    """Every acceptance length, EOS and budgets cut inside a block, rows joining and leaving: each
    row equals the target's greedy output; the passes were replayed, not rebuilt each cycle (a
    GatedDeltaNet target's stay eager: its tape)."""
    if target_kind == "qwen3":
        target, config = qwen3_target, synthetic.tiny_qwen3_config()
    else:
        config = synthetic.tiny_qwen3_5_config(layers=8)
        target = synthetic.save_target(model_dir / "q35-compiled", config, seed=1)
    drafter = make_drafter(model_dir, f"d-{target_kind}-8", config, block_size=8)
    engine, _, ids, refs = scripted_batch(
        target, drafter, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=False
    )
    verify, draft = engine.target.passes, engine.drafter.passes
    before = dict(verify.calls), dict(draft.calls)
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
    for n, (c, ref) in enumerate(zip(batched, refs)):
        assert c.token_ids == ref, f"row {n}"
    calls = {k: verify.calls[k] - before[0][k] for k in before[0]}
    if target_kind == "qwen3_5":
        assert calls["compiled"] == 0
    else:
        assert calls["compiled"] > 3 * verify.traced, calls  # mostly replays
    # the drafter's pass compiles whatever the target (its cache is attention only): mostly replays too
    drafts = {k: draft.calls[k] - before[1][k] for k in before[1]}
    assert drafts["compiled"] > 3 * draft.traced, drafts


def test_a_change_of_routing_traces_again(tiny_pair, passes_compiled):
    """A trace holds the routing chosen while tracing: another routing gets its own (the verify
    pass's and the drafter's)."""
    # whole blocks: cycles of T >= 2 under both routings (adaptive widths follow timings, and on a
    # loaded machine may choose plain steps only, which stay eager)
    engine = load_engine(*map(str, tiny_pair), adaptive_block=False)
    want = [
        c.token_ids
        for c in engine.generate_batch(synthetic.LOSSLESS_PROMPTS, max_tokens=24, batch_size=1)
    ]
    with engine_modes(engine, attention="reference"):
        got = [
            c.token_ids
            for c in engine.generate_batch(synthetic.LOSSLESS_PROMPTS, max_tokens=24, batch_size=1)
        ]
    assert got == want
    # a routing per trace, for the chain passes and (trees being the CPU's default) the tree passes alike
    for passes in (engine.target.passes, engine.drafter.passes):
        assert passes._compiled
        for kind in {key[-1] for key in passes._compiled}:
            assert len([key for key in passes._compiled if key[-1] == kind]) == 2


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


# -- the drafter's pass ---------------------------------------------------------------------------
DRAFT_LENGTHS, DRAFT_COUNTS = (
    [5, 17, 3],
    [2, 4, 0],
)  # rows of their own cache lengths and new context rows


def draft_differences(engine) -> list:
    """What differs between the eager drafter pass and three compiled ones (the first eagerly
    through the view, then a trace, then a replay) over ragged rows: the drafts, their logits, and
    per row the K/V it keeps (context up to its new length n_b + c_b) and the block's after it
    (columns n_b + c_b + L, both passes write them); past n_b + L + P (the compiled pass's padding
    rows end there) nothing may be written."""
    target, drafter = engine.target, engine.drafter
    L = P = drafter.args.block_size
    attn = drafter.layers[0].self_attn
    width, B, S = 512, len(DRAFT_LENGTHS), max(DRAFT_COUNTS)
    context = mx.random.normal((B, S, drafter.fc.weight.shape[1]), key=mx.random.key(3))
    last = mx.array([[7], [11], [13]], dtype=mx.int32)
    counts = mx.array(DRAFT_COUNTS, dtype=mx.int32)
    made_up = [
        mx.random.normal((B, attn.n_kv_heads, width, attn.head_dim), key=mx.random.key(k))
        for k in (1, 2)
    ]

    def draft(passes: str):
        cache = drafter.make_cache(Lengths(DRAFT_LENGTHS), width)
        for c in cache:  # rows of made-up context, as earlier cycles leave them
            c.keys, c.values = made_up
        with switch.modes(passes=passes):
            ids, logits = decode.draft_block(
                drafter, target, last, context, counts, cache, L - 1, with_logits=True
            )
        return ids, logits, cache

    want_ids, want_logits, want_cache = draft("eager")
    differences = []
    for run in range(3):
        ids, logits, cache = draft("compiled")
        if not mx.array_equal(ids, want_ids).item():
            differences.append(f"run {run}: draft ids")
        if not mx.allclose(logits, want_logits, atol=1e-5).item():
            differences.append(f"run {run}: logits")
        for layer, (c, e) in enumerate(zip(cache, want_cache)):
            kv = (("keys", c.keys, e.keys, made_up[0]), ("values", c.values, e.values, made_up[1]))
            for name, got, expected, fresh in kv:
                for b, (n, k) in enumerate(zip(DRAFT_LENGTHS, DRAFT_COUNTS)):
                    if not mx.allclose(
                        got[b, :, : n + k + L], expected[b, :, : n + k + L], atol=1e-5
                    ).item():
                        differences.append(f"run {run}: layer {layer} row {b}: {name} kept")
                    if not mx.array_equal(got[b, :, n + L + P :], fresh[b, :, n + L + P :]).item():
                        differences.append(
                            f"run {run}: layer {layer} row {b}: {name} written past n + L + P"
                        )
    return differences


def test_a_compiled_draft_pass_equals_the_eager_pass_on_ragged_rows(tiny_pair):
    """Rows of different draft-cache lengths bringing different counts of new context rows (one
    none): the same drafts, logits and K/V kept as the eager pass; the third pass a replay."""
    engine = load_engine(*map(str, tiny_pair))
    passes = engine.drafter.passes
    assert draft_differences(engine) == []
    assert (
        passes.calls == {"eager": 1, "compiled": 2} and passes.traced == 2
    )  # the third ran no Python


def test_a_draft_scatter_one_column_off_is_caught(tiny_pair, monkeypatch):
    """Negative control: the compiled view writing every row one column late fails the comparison
    above (the keys each row keeps, and a write past the padding)."""
    real = compiled._FixedWidthView.write_columns

    def one_off(view, columns, keys, values, reach):
        return real(view, columns + 1, keys, values, reach)

    monkeypatch.setattr(compiled._FixedWidthView, "write_columns", one_off)
    differences = draft_differences(load_engine(*map(str, tiny_pair)))
    assert any("keys kept" in d for d in differences) and any("past" in d for d in differences), (
        differences
    )


def test_compiled_drafts_equal_eager_drafts_in_a_batch(tiny_pair, monkeypatch, chain_drafts):
    """A batch of rows that join, accept and leave on their own, with the real drafter: every
    cycle's drafts are the eager drafter's, and most of its passes were replays."""
    engine = load_engine(
        *map(str, tiny_pair), prefill_chunk=64, adaptive_block=False
    )  # widths fixed: cycles alike
    prompts = list(synthetic.LOSSLESS_PROMPTS) + ["x", "one two three four five six seven"]
    budgets = [20, 33, 9, 40, 27][: len(prompts)]  # rows leave at different cycles, others join
    runs = eager_and_compiled_drafts(engine, monkeypatch, prompts, budgets)
    assert runs["compiled"] == runs["eager"]
    assert len(runs["eager"][1]) > 10
    calls = engine.drafter.passes.calls
    assert calls["compiled"] > 2 * engine.drafter.passes.traced, calls


def test_draft_passes_stay_eager_where_they_cannot_compile(tiny_pair, passes_compiled):
    """More new context rows than P, no room past the longest row for the block and P padding
    rows, a cache off the ladder, eager mode: the eager pass."""
    drafter = load_engine(*map(str, tiny_pair)).drafter
    passes, L = drafter.passes, drafter.args.block_size
    x = mx.zeros((1, L, drafter.args.hidden_size))

    def cache(n: int, width: int):
        c = drafter.make_cache(Lengths([n]), width)
        drafter.add_context(
            mx.zeros((1, 1, drafter.fc.weight.shape[1])), c
        )  # allocates the buffers
        return c

    context = mx.zeros((1, passes.rows, drafter.fc.weight.shape[1]))
    assert passes.applies(x, context, cache(3, 512))
    assert passes.applies(x, context[:, :0], cache(3, 512))  # no new context: padding rows only
    assert not passes.applies(x, mx.zeros((1, passes.rows + 1, context.shape[2])), cache(3, 512))
    assert passes.applies(x, context, cache(512 - L - passes.rows, 512))
    assert not passes.applies(x, context, cache(512 - L - passes.rows + 1, 512))
    assert not passes.applies(x, context, cache(3, 768))
    with switch.modes(passes="eager"):
        assert not passes.applies(x, context, cache(3, 512))
