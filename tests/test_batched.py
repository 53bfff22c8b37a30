"""Batched DFlash: every row of a batch equals that prompt decoded alone, and mlx-lm's own greedy
decoding, token for token (fp32, CPU), whatever the other rows are; rollback never touches
another row; rows join and leave mid-run; per-row statistics stay per row."""

from __future__ import annotations

from dflash_batch.engine import load_engine, memory
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.models import hybrid
from dflash_batch.engine.ops.batch_cache import Lengths, RaggedKVCache
from dflash_batch.engine.ops.kernels import gated_delta as gd

import mlx.core as mx
import pytest

from dflash_batch.completion import GenerationError
from tests import synthetic
from tests.helpers import (
    MAX_TOKENS,
    P_WRONG,
    PROMPTS_B,
    fixed_costs,
    greedy_reference,
    scripted_batch,
)
from tests.scripting import ScriptedDrafts


def _engine(target, draft, **kw):
    return load_engine(str(target), str(draft), prefill_chunk=256, **kw)


def _alone_and_batched(engine, prompts, batch_size, max_tokens, **kw):
    """Each prompt generated alone, then all of them in one batched run."""
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    alone = [engine.generate(p, max_tokens=m, **kw) for p, m in zip(prompts, budgets)]
    return alone, engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=batch_size, **kw)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("adaptive", [False, True])
def test_rows_equal_batch_one_and_mlx_lm_greedy(
    qwen3_target, qwen3_b8, monkeypatch, chain_drafts, batch_size, adaptive
):
    engine, script, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=adaptive
    )
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
    for n, (c, ref) in enumerate(zip(batched, refs)):
        assert c.token_ids == ref, f"row {n}"
    # Rescript with the same seeds: each row alone draws the same corruptions as in the batch.
    script.references.clear()
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 16, p_wrong=P_WRONG[n], seed=n)
    alone = [engine.generate(i, max_tokens=m) for i, m in zip(ids, MAX_TOKENS)]
    assert [c.token_ids for c in alone] == refs
    if (
        not adaptive
    ):  # whole blocks: every committed length occurs, a row's cycles do not depend on the batch
        hist = [sum(h) for h in zip(*(c.stats.acceptance_histogram for c in batched))]
        assert all(hist[1:]), hist
        for n, (a, b) in enumerate(zip(alone, batched)):
            assert a.stats.acceptance_histogram == b.stats.acceptance_histogram, f"row {n}"
            assert (
                a.stats.cycles,
                a.stats.accepted_tokens,
                a.stats.drafted_tokens,
                a.stats.generated_tokens,
            ) == (
                b.stats.cycles,
                b.stats.accepted_tokens,
                b.stats.drafted_tokens,
                b.stats.generated_tokens,
            )


@pytest.mark.parametrize("target_name", ["llama", "qwen35"])
def test_other_targets_batched_equal_alone(request, model_dir, tmp_path, monkeypatch, target_name):
    if target_name == "llama":
        target = request.getfixturevalue("llama_target")
        cfg = synthetic.tiny_llama_config()
    else:
        cfg = synthetic.tiny_qwen3_5_config(layers=8)
        target = synthetic.save_target(tmp_path / "q35", cfg, seed=1)
    draft = synthetic.save_drafter(
        tmp_path / "d", synthetic.drafter_config(cfg, block_size=8), seed=3
    )
    engine, _, ids, refs = scripted_batch(target, draft, monkeypatch, PROMPTS_B[:6])
    batched = engine.generate_batch(ids, max_tokens=30, batch_size=4)
    assert [c.token_ids for c in batched] == refs


def test_random_drafter_rows_equal_alone(tiny_pair):
    """No scripting: the real random drafter, acceptance about one token per cycle."""
    engine = _engine(*tiny_pair)
    alone, batched = _alone_and_batched(engine, PROMPTS_B, 4, max_tokens=MAX_TOKENS)
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]


def test_eos_and_stop_string_inside_blocks_per_row(qwen3_target, qwen3_b8, monkeypatch):
    engine = _engine(qwen3_target, qwen3_b8, adaptive_block=False)
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in PROMPTS_B[:6]]
    refs = [greedy_reference(qwen3_target, i, 60, engine.tokenizer.eos_token_ids) for i in ids]
    for i, ref in zip(ids, refs):
        script(i + ref + [0] * 16, p_wrong=0.0)  # whole blocks accepted: cuts fall inside them
    # An EOS id that occurs mid-output in row 0 (other rows stop at it too, where it occurs).
    k = next(i for i in range(9, len(refs[0])) if refs[0][i] not in refs[0][:i])
    engine.tokenizer.eos_token_ids = {refs[0][k]}
    alone, batched = _alone_and_batched(engine, ids, 3, max_tokens=60)
    assert batched[0].token_ids == refs[0][:k] and batched[0].stop_reason == "eos"
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in batched] == [c.finish_reason for c in alone]
    engine.tokenizer.eos_token_ids = set()
    text = engine.generate(ids[1], max_tokens=60).text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    alone, batched = _alone_and_batched(engine, ids, 3, max_tokens=60, stop=[stop])
    assert batched[1].stop_reason == stop and batched[1].text == text[: text.find(stop)]
    assert [(c.text, c.token_ids, c.stop_reason) for c in batched] == [
        (c.text, c.token_ids, c.stop_reason) for c in alone
    ]


def test_rows_join_and_leave_mid_run(qwen3_target, qwen3_b8, monkeypatch):
    """Two slots, six prompts of very different budgets: rows leave at their own time and the
    waiting prompts take their slots; completions stream out as rows finish."""
    engine = _engine(qwen3_target, qwen3_b8)
    prompts = PROMPTS_B[:6]
    budgets = [40, 3, 25, 1, 60, 9]
    alone = [engine.generate(p, max_tokens=m).token_ids for p, m in zip(prompts, budgets)]
    order = []
    for index, c in engine.stream_batch(prompts, max_tokens=budgets, batch_size=2):
        order.append(index)
        assert c.token_ids == alone[index]
    assert sorted(order) == list(range(6)) and order != list(
        range(6)
    )  # finished out of input order


def test_sampled_rows_equal_alone_with_the_same_seed(tiny_pair):
    engine = _engine(*tiny_pair)
    prompts = PROMPTS_B[:5]
    temps = [0.0, 0.7, 1.0, 0.7, 0.3]
    alone = [
        engine.generate(p, max_tokens=30, temperature=t, seed=40 + i).token_ids
        for i, (p, t) in enumerate(zip(prompts, temps))
    ]
    batched = engine.generate_batch(
        prompts, max_tokens=30, temperature=temps, seed=40, batch_size=3
    )
    assert [c.token_ids for c in batched] == alone


def test_bad_prompt_in_a_batch_is_named_before_any_work(tiny_pair):
    engine = _engine(*tiny_pair)
    with pytest.raises(GenerationError, match="prompt 2: prompt is empty"):
        engine.generate_batch(["Hi", "there", "   "], max_tokens=5)
    with pytest.raises(GenerationError, match="max_tokens has 2 values for 3 prompts"):
        engine.generate_batch(["Hi", "there", "you"], max_tokens=[5, 6])
    with pytest.raises(GenerationError, match="temperature"):
        engine.generate_batch(["Hi"], temperature=float("nan"))


def test_batch_size_follows_memory(tiny_pair, monkeypatch):
    engine = _engine(*tiny_pair)
    requests = [engine.request("Hi", max_tokens=100, index=i) for i in range(8)]
    per_row = memory.row_bytes(engine, len(requests[0].ids) + 100 + engine.block_size)
    used = mx.get_active_memory()
    # room for 3.5 rows: 3 fit, 4 do not (exactly 3 was a knife-edge: the GB figure's float
    # rounding could leave a byte short, and 2 rows fit)
    monkeypatch.setenv("DFLASH_BATCH_MEMORY_GB", str((used + 3.5 * per_row / 0.8) / 1e9))
    assert engine.plan_batch(requests) == 3
    assert engine.plan_batch(requests, batch_size=2) == 2
    monkeypatch.setenv("DFLASH_BATCH_MEMORY_GB", str((used + per_row / 4) / 1e9))
    with pytest.raises(GenerationError, match="not enough memory for one sequence"):
        engine.generate_batch(["Hi", "there"], max_tokens=100)


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_cache_is_allocated_once_for_its_longest_row(tiny_pair, monkeypatch, stream):
    """The plan's memory is the memory used: each batch cache (target and drafter) is allocated
    once, for the longest row the job can reach, and never grown (growing copies the buffer, so for
    a moment it takes twice the memory the plan counted: a GPU ran out of memory mid-job that way)."""
    grown, batch_caches = [], set()
    reserve, init = RaggedKVCache.reserve, BatchDecoder.__init__

    def watched(self, columns, like_k, like_v):
        have = 0 if self.keys is None else self.keys.shape[2]
        reserve(self, columns, like_k, like_v)
        if have and self.keys.shape[2] > have and id(self) in batch_caches:
            grown.append((have, self.keys.shape[2]))

    def decoder(self, *args, **kw):
        init(self, *args, **kw)
        batch_caches.update(id(c) for c in self.cache + (self.draft_cache or []))

    monkeypatch.setattr(RaggedKVCache, "reserve", watched)
    monkeypatch.setattr(BatchDecoder, "__init__", decoder)
    engine = _engine(*tiny_pair)
    prompts = ["Hi", "there, how are you today", "tell me about the sea and the ships on it"]
    budgets = [300, 40, 290]  # rows reach well past the first STEP of 256 positions
    if stream:
        from dflash_batch.request import Options, Request

        requests = [
            Request(id=str(i), prompt=p, options=Options(max_tokens=n))
            for i, (p, n) in enumerate(zip(prompts, budgets))
        ]
        done = [c for _, c in engine.generate_requests(requests, batch_size=2)]
    else:
        done = engine.generate_batch(prompts, max_tokens=budgets, batch_size=2)
    assert sum(c.stats.generated_tokens for c in done) > 256 and batch_caches
    assert grown == []


# -- per-row rollback never touches another row ---------------------------------------------------


def test_ragged_kv_rows_keep_their_own_lengths():
    """Writes of a pass land at each row's own length; rows hold what they alone would hold."""
    mx.random.seed(0)
    lengths = Lengths([3, 7, 0])
    cache = RaggedKVCache(lengths)
    base = mx.random.normal((3, 2, 8, 4))
    cache.keys, cache.values = mx.zeros((3, 2, 256, 4)), mx.zeros((3, 2, 256, 4))
    for b, n in enumerate(lengths.host):
        cache.keys[b, :, :n], cache.values[b, :, :n] = base[b, :, :n], base[b, :, :n] * 2
    new = mx.random.normal((3, 2, 5, 4))
    keys, _ = cache.update_and_fetch(new, new)
    mask = cache.make_mask(5)
    for b, n in enumerate(lengths.host):
        assert mx.array_equal(keys[b, :, :n], base[b, :, :n]).item()  # old rows untouched
        assert mx.array_equal(keys[b, :, n : n + 5], new[b]).item()
        assert mask[b, 0, 0, : n + 1].all().item() and not mask[b, 0, 0, n + 1 :].any().item()
    lengths.advance([1, 5, 2])
    assert lengths.host == [4, 12, 2]


def test_tape_rollback_per_row_equals_each_row_alone():
    """Rows of one armed pass keep 0..T steps each: every row's recurrent and conv state equal
    that row's tape replayed alone, bit for bit. Using any other row's keep fails this."""
    mx.random.seed(3)
    B, T, Hk, Hv, D, K = 4, 6, 2, 4, 32, 4
    state = mx.random.normal((B, Hv, D, D))
    delta = mx.random.normal((B, T, Hv, D))
    k = mx.random.normal((B, T, Hk, D))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
    conv_input = mx.random.normal((B, K - 1 + T, 16))
    keep = [0, 6, 2, 5]
    final = gd.replay(delta, k, g, state)  # what the pass itself leaves in the cache

    def cache_after_pass(rows):
        c = hybrid.TapeCache()
        c[0], c[1] = conv_input[rows, T:], final[rows]
        c.record(state[rows], delta[rows], k[rows], g[rows], conv_input[rows])
        return c

    batch = cache_after_pass(slice(None))
    batch.trim_rows(keep)
    for b in range(B):
        one = cache_after_pass(slice(b, b + 1))
        one.trim(T - keep[b])
        assert mx.array_equal(batch[1][b : b + 1], one[1]).item(), b
        assert mx.array_equal(batch[0][b : b + 1], one[0]).item(), b
    assert batch.tape is None and not batch.armed


def test_hybrid_verify_pass_rolls_back_rows_independently(tmp_path):
    """A real qwen3_5 pass over 4 rows rolled back to different keeps: each row's states match
    that row run alone (to rounding: the batch changes matmul shapes)."""
    cfg = synthetic.tiny_qwen3_5_config(layers=4)
    target = load_engine(str(synthetic.save_target(tmp_path / "q", cfg, seed=2)), None).target
    prompt = mx.array([[5, 9, 100], [6, 9, 101], [7, 9, 102], [8, 9, 103]])
    block = mx.array(
        [
            [11, 250, 3, 99, 402, 17],
            [1, 2, 3, 4, 5, 6],
            [7, 8, 9, 10, 11, 12],
            [40, 41, 42, 43, 44, 45],
        ]
    )
    keep = [0, 6, 2, 5]

    def run(rows, keeps):
        lengths = Lengths([0] * len(rows))
        cache = target.make_cache(lengths)
        target(prompt[rows], cache)
        lengths.advance([3] * len(rows))
        target.verify(block[rows], cache)
        target.rollback(cache, keeps)
        return [(c[0], c[1]) for c in cache if isinstance(c, hybrid.TapeCache)]

    together = run(mx.arange(4), keep)
    for b in range(4):
        for (conv, state), (conv1, state1) in zip(together, run(mx.array([b]), [keep[b]])):
            assert mx.allclose(conv[b : b + 1], conv1, atol=1e-5).item(), b
            assert mx.allclose(state[b : b + 1], state1, atol=1e-5).item(), b


def test_a_long_joining_prompt_is_prefilled_in_chunks_between_cycles(tiny_pair):
    """One chunk of a joining prompt per step while another row decodes: the decoding row keeps
    committing tokens while the long prompt is prefilled, and both outputs are unchanged."""
    engine = load_engine(str(tiny_pair[0]), str(tiny_pair[1]), prefill_chunk=128)
    short, long_ = engine.encode("Hi"), [(i * 37) % 500 + 4 for i in range(1000)]
    alone = [engine.generate(p, max_tokens=60).token_ids for p in (short, long_)]
    events = []
    requests = [
        engine.request(short, max_tokens=60, index=0),
        engine.request(long_, max_tokens=60, index=1),
    ]
    decoder = BatchDecoder(engine, requests, 2, engine._width_policy(2))
    chunks = []
    prefill_pass = decoder._prefill_pass

    def counted(width):
        chunks.extend((j.row.request.index, len(events)) for j in decoder.group.joiners)
        return (yield from prefill_pass(width))

    decoder._prefill_pass = counted
    tokens = {0: [], 1: []}
    for index, piece in decoder.steps():
        events.append(index)
        tokens[index] += piece.token_ids
    assert [tokens[0], tokens[1]] == alone
    long_chunks = [at for i, at in chunks if i == 1]
    assert len(long_chunks) >= 8  # 1000 tokens, at most 128 a chunk
    assert long_chunks[-1] - long_chunks[0] >= 5  # the short row committed tokens in between


def test_ragged_batch_through_the_block_attention_reference_is_lossless(
    qwen3_target, qwen3_b8, monkeypatch
):
    """The routed path (per-row key lengths), as the GPU kernels run it, in its pure-MLX form."""
    from dflash_batch.engine.ops import attention

    engine, _, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, attention="reference"
    )
    before = attention.counters()["routed"]
    assert [c.token_ids for c in engine.generate_batch(ids, max_tokens=30, batch_size=3)] == refs
    assert attention.counters()["routed"] > before


@pytest.mark.parametrize("route", ["block", "sdpa"])
def test_both_ragged_routes_are_lossless(qwen3_target, qwen3_b8, monkeypatch, route):
    """The warm-up picks one of two routes for ragged batches (engine/ops/attention.py): block
    attention with per-row key lengths, or stock SDPA over the bucketed cache with a per-row mask.
    Each must give every row its batch-1 greedy output. The route is the cost model's."""
    import dataclasses

    from dflash_batch.engine.ops import attention

    # "reference": "block" then runs the kernels' pure-MLX form, not stock SDPA
    engine, _, ids, refs = scripted_batch(
        qwen3_target,
        qwen3_b8,
        monkeypatch,
        attention="reference",
        cost_model=dataclasses.replace(fixed_costs(), route=route),
    )
    ragged = []  # calls of the block attention with per-row key lengths
    block_attention = attention._block_attention

    def counted(impl, q, k, v, scale, causal, window, kv_len=None, sinks=None):
        ragged.append(
            kv_len is not None and q.shape[2] > 1
        )  # plain one-row steps take "block" on either route
        return block_attention(impl, q, k, v, scale, causal, window, kv_len, sinks)

    monkeypatch.setattr(attention, "_block_attention", counted)
    assert [c.token_ids for c in engine.generate_batch(ids, max_tokens=30, batch_size=3)] == refs
    assert any(ragged) == (route == "block")
