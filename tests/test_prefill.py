"""Joining prompts: packed prefill (several prompts' chunks in one ragged pass), prefixes prefilled
once and shared, n samples of a prompt sharing its prefill. Every row equals that prompt prefilled
and decoded alone (fp32, CPU), for a pure-attention and a hybrid (GatedDeltaNet) target."""

from __future__ import annotations

import random

from dflash_batch.engine import load_engine, prefill
from dflash_batch.engine.models import hybrid

import mlx.core as mx
import pytest

from dflash_batch.completion import GenerationError
from dflash_batch.request import sample_seed
from tests import synthetic
from tests.helpers import StepClock, greedy_reference

LENGTHS = [3, 41, 150, 333]  # very different prompt lengths, most over the 64-token chunk below


def _ids(length: int, seed: int):
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(length)]


@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def pair(request, tmp_path_factory):
    """(target folder, drafter folder) of one target kind."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        cfg = synthetic.tiny_qwen3_config()
    else:
        cfg = synthetic.tiny_qwen3_5_config(layers=4)
    target = synthetic.save_target(root / "t", cfg, seed=1)
    draft = synthetic.save_drafter(root / "d", synthetic.drafter_config(cfg, block_size=8), seed=3)
    return target, draft


def _engine(pair, **kw):
    kw.setdefault("prefix_cache_mb", 0)
    return load_engine(str(pair[0]), str(pair[1]), prefill_chunk=64, **kw)


# -- packed prefill ------------------------------------------------------------------------------


def _group_states(engine, prompts, width):
    """Prefill ``prompts`` as one group (packed passes of ``width``); each prompt's final state."""
    group = prefill.JoinGroup(engine.target, engine.drafter, None)
    for i, ids in enumerate(prompts):
        group.add(prefill.Joiner(row=None, slot=i, ids=ids, done=0), None)
    states, passes = {}, 0
    while group.joiners:
        for joiner, state in group.prefill(width):
            states[joiner.slot] = state
        passes += 1
    return [states[i] for i in range(len(prompts))], passes


def _close(a, b):
    """Equal up to fp32 rounding: within 2e-4 of each array's scale (at least 1). The same prompt
    in passes of other shapes rounds differently: up to 1.9e-4 in keys of scale 3.5 after three
    GatedDeltaNet layers over 333 tokens, the size depending on what ran before in the process.
    One token disturbed moves a state by far more (``test_one_token_disturbed_is_not_close``)."""
    return (
        a is None
        and b is None
        or all(
            (mx.abs(x - y) <= 2e-4 * mx.maximum(mx.abs(y).max(), 1.0)).all().item()
            for x, y in zip(a, b)
        )
    )


def test_packed_prefill_state_equals_each_prompt_alone(pair):
    """Four prompts of 3 to 333 tokens prefilled together: every layer's state of every row (keys
    and values, conv and recurrent states, the tapped rows that are the drafter's context) and its
    last logits equal that prompt prefilled alone. Padding absorbed by a recurrent row, or written where a row reads it,
    fails this."""
    engine = _engine(pair)
    prompts = [_ids(n, seed=n) for n in LENGTHS]
    together, passes = _group_states(engine, prompts, 64)
    assert passes < sum(-(-n // 64) for n in LENGTHS)  # the prompts' chunks shared passes
    assert any(isinstance(c, hybrid.TapeCache) for c in engine.target.make_cache()) == (
        pair[0].parent.name.startswith("qwen35")
    )
    for n, (ids, packed) in enumerate(zip(prompts, together)):
        alone, _ = _group_states(engine, [ids], 64)
        alone = alone[0]
        assert packed.length == alone.length == len(ids)
        assert mx.allclose(packed.logits, alone.logits, rtol=1e-4, atol=1e-4).item(), n
        for layer, (p, a) in enumerate(
            zip(packed.target + [(packed.hidden,)], alone.target + [(alone.hidden,)])
        ):
            assert _close(p, a), (n, layer)


def test_one_token_disturbed_is_not_close(pair):
    """Negative control for the comparison above: a prompt with its last-but-one token changed (a
    padding token absorbed at the end of a row's chunk, or a key written where the row reads,
    changes it like that) differs from the prompt's own state in every layer that holds state,
    and in each of its arrays. (A token changed halfway fades from a recurrent state by the end.)"""
    engine = _engine(pair)
    ids = _ids(LENGTHS[-1], seed=LENGTHS[-1])
    other = list(ids)
    other[-2] = (other[-2] + 1) % 200 + 1
    (want,), _ = _group_states(engine, [ids], 64)
    (got,), _ = _group_states(engine, [other], 64)
    layers = [
        (p, a)
        for p, a in zip(got.target + [(got.hidden,)], want.target + [(want.hidden,)])
        if a is not None
    ]
    assert layers and not any(_close([x], [y]) for p, a in layers for x, y in zip(p, a))


def test_packed_prefill_rows_equal_greedy(pair):
    """Prompts of very different lengths join a batch together and are prefilled in shared
    passes; every row equals mlx-lm's greedy decoding of that prompt alone."""
    engine = _engine(pair)
    prompts = [_ids(n, seed=10 + n) for n in LENGTHS + [90, 7]]
    eos = engine.tokenizer.eos_token_ids
    refs = [greedy_reference(pair[0], ids, 20, eos) for ids in prompts]
    out = engine.generate_batch(prompts, max_tokens=20, batch_size=4)
    assert [c.token_ids for c in out] == refs
    counts = engine.prefill_counts
    assert counts["tokens"] == sum(len(p) for p in prompts)
    chunks_alone = sum(-(-len(p) // 64) for p in prompts)
    assert (
        counts["passes"] < chunks_alone and counts["padding"] > 0
    )  # packed, rows of their own lengths


def test_packed_pass_width_stays_within_the_token_bound(pair):
    engine = _engine(pair, prefill_tokens=96)
    prompts = [_ids(n, seed=20 + n) for n in LENGTHS]
    widths = []
    real = prefill.JoinGroup.prefill

    def spy(group, width):
        widths.append((len(group.joiners), width))
        return real(group, width)

    prefill.JoinGroup.prefill = spy
    try:
        out = engine.generate_batch(prompts, max_tokens=5, batch_size=4)
    finally:
        prefill.JoinGroup.prefill = real
    assert all(rows * width <= 96 or rows == 1 and width <= 64 for rows, width in widths), widths
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [greedy_reference(pair[0], p, 5, eos) for p in prompts]


def test_the_joining_group_holds_about_one_pass_of_prompt_tokens(pair, monkeypatch):
    """Joining rows keep their own cache until placed in the batch's: a group of every free slot's
    prompt (64 rows x 2048 tokens at a job's start on a GPU) held the batch's cache twice over and
    ran out of memory. A row joins the group only while it has less than a pass's worth to prefill."""
    engine = _engine(pair, prefill_tokens=96)
    prompts = [_ids(60, seed=40 + i) for i in range(6)]
    pending = []
    real = prefill.JoinGroup.add

    def spy(group, joiner, start):
        pending.append(group.pending())
        return real(group, joiner, start)

    monkeypatch.setattr(prefill.JoinGroup, "add", spy)
    out = engine.generate_batch(prompts, max_tokens=5, batch_size=6)
    assert len(pending) == 6 and max(pending) < 96, pending
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [greedy_reference(pair[0], p, 5, eos) for p in prompts]


# -- shared prefixes -----------------------------------------------------------------------------


def test_shared_instruction_is_prefilled_once_and_results_are_unchanged(pair):
    """Items behind one 200-token instruction: the instruction (to 192 tokens, the granularity's
    multiple) is prefilled once, and every item equals prefilling it alone, greedy and sampled."""
    instruction = _ids(200, seed=99)
    prompts = [instruction + _ids(n, seed=n) for n in (5, 60, 1, 130, 33)] + [_ids(70, seed=7)]
    temps = [0.0, 0.0, 0.9, 0.0, 0.7, 0.0]
    eos = None
    shared = _engine(pair, prefix_cache_mb=64, prefix_granularity=32)
    out = shared.generate_batch(prompts, max_tokens=16, temperature=temps, seed=3, batch_size=3)
    saved = shared.prefill_counts["tokens"]
    alone = _engine(pair)
    eos = alone.tokenizer.eos_token_ids
    ref = alone.generate_batch(prompts, max_tokens=16, temperature=temps, seed=3, batch_size=3)
    assert alone.prefill_counts["tokens"] == sum(len(p) for p in prompts)
    assert saved == sum(len(p) for p in prompts) - 4 * 192  # five items, the shared 192 once
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for i in (0, 1, 3, 5):
        assert out[i].token_ids == greedy_reference(pair[0], prompts[i], 16, eos), i


def test_prefix_cache_keeps_to_its_memory_bound():
    cache = prefill.PrefixCache(limit=3000, granularity=4)

    def entry(n):
        return prefill.Prefix(
            n,
            [(mx.zeros((1, 1, n, 100)), mx.zeros((1, 1, n, 100)))],
            None,
            mx.zeros((1, 1, 10)),
            None,
        )

    cache.put((1, 2, 3, 4), entry(1))  # 840 bytes
    cache.put((1, 2, 3, 4, 5, 6, 7, 8), entry(2))  # 1640
    assert cache.longest([1, 2, 3, 4, 5, 6, 7, 8, 9]).length == 2
    assert cache.longest([1, 2, 3, 4, 9]).length == 1  # (1, 2, 3, 4) is now the most recent
    cache.put((9, 9, 9, 9), entry(1))  # over 3000: the least recently used goes
    assert cache.bytes <= 3000 and (1, 2, 3, 4, 5, 6, 7, 8) not in cache and (1, 2, 3, 4) in cache
    cache.put((5, 5, 5, 5), entry(4))  # larger than the bound: not kept
    assert (5, 5, 5, 5) not in cache
    assert cache.longest([1, 2, 3]) is None


def test_share_marks():
    a, b = list(range(100)), list(range(70)) + [1000] * 5
    marks = prefill.share_marks([a, b, [5, 6], list(a), [5, 6, 7]], 32)
    assert marks == [[64, 100], [64], [], [64, 100], []]


# -- n samples -----------------------------------------------------------------------------------


def test_n_samples_share_one_prefill_and_equal_each_sample_alone(pair):
    engine = _engine(pair, prefix_cache_mb=64)
    prompts = [_ids(200, seed=1), _ids(45, seed=2)]
    out = engine.generate_batch(prompts, n=4, max_tokens=12, temperature=1.0, seed=11, batch_size=3)
    assert engine.prefill_counts["tokens"] == 245  # each prompt prefilled once for its four samples
    assert [c.sample_index for c in out] == [0, 1, 2, 3] * 2
    assert len({tuple(c.token_ids) for c in out[:4]}) > 1  # samples of their own
    alone = _engine(pair)
    for i, p in enumerate(prompts):
        for k in range(4):
            one = alone.generate(p, max_tokens=12, temperature=1.0, seed=sample_seed(11 + i, k))
            assert out[i * 4 + k].token_ids == one.token_ids, (i, k)
    again = engine.generate_batch(
        prompts, n=4, max_tokens=12, temperature=1.0, seed=11, batch_size=2
    )
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # reproducible from the seed


def test_n_is_checked(pair):
    engine = _engine(pair)
    with pytest.raises(GenerationError, match="n must be an integer of at least 1"):
        engine.generate_batch(["Hi"], n=0)


def test_one_prompt_per_pass_when_asked(pair):
    """prefill_rows=1: joining prompts are prefilled one per pass (as before packing), no padding,
    the same output."""
    prompts = [_ids(n, seed=30 + n) for n in LENGTHS]
    one = _engine(pair, prefill_rows=1)
    packed = _engine(pair)
    a = one.generate_batch(prompts, max_tokens=6, batch_size=4)
    b = packed.generate_batch(prompts, max_tokens=6, batch_size=4)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert (
        one.prefill_counts["passes"] == sum(-(-len(p) // 64) for p in prompts)
        and one.prefill_counts["padding"] == 0
    )
    assert packed.prefill_counts["passes"] < one.prefill_counts["passes"]


# -- the LM head only where a prefill pass needs it ------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_tied", "llama", "qwen35"])
def test_logits_at_chosen_positions_equal_the_full_pass(kind, tmp_path):
    """``Target(tokens, cache, at)`` runs the LM head on row b's position at[b] only: the same
    logits and taps as the whole pass. A head-after-backbone model
    takes the short path (a model file outside the list runs its whole forward)."""
    from dflash_batch.engine.models.target import Target
    from dflash_batch.engine.ops.batch_cache import Lengths

    from mlx_lm.utils import load

    cfg = {"qwen3": synthetic.tiny_qwen3_config(), "llama": synthetic.tiny_llama_config(),
           "qwen35": synthetic.tiny_qwen3_5_config(layers=4)}.get(kind) or dict(synthetic.tiny_qwen3_config(), tie_word_embeddings=True)  # fmt: skip
    model, _ = load(str(synthetic.save_target(tmp_path / kind, cfg, seed=5)))
    target = Target(model, tap_ids=[0, 2])
    assert target.head_after_backbone
    tokens = mx.array([_ids(9, 1), _ids(9, 2), _ids(9, 3)], dtype=mx.int32)
    at = mx.array([8, 3, 5], dtype=mx.int32)
    runs = []
    for chosen in (None, at):
        lengths = Lengths([0, 0, 0])
        cache = target.make_cache(lengths)
        logits, hidden = target(tokens, cache, chosen)
        if chosen is None:
            logits = logits[mx.arange(3), at][:, None, :]
        mx.eval(logits, hidden)
        runs.append((logits, hidden))
    (full, h_full), (short, h_short) = runs
    assert short.shape == (3, 1, target.vocab_size)
    assert mx.allclose(full, short, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(h_full, h_short).item()
    target.head_after_backbone = False  # the whole forward, then the positions picked
    logits, _ = target(tokens, target.make_cache(Lengths([0, 0, 0])), at)
    assert mx.allclose(full, logits, rtol=1e-5, atol=1e-5).item()


# -- joins gathered into one pass ----------------------------------------------------------------


def test_prefill_cost_fits_its_fixed_part():
    cost = prefill.PrefillCost()
    cost.observe(64, 0.1 + 0.002 * 64)
    assert cost.fixed() is None  # one size: fixed and per-token parts not told apart
    for tokens in (16, 128, 640):
        cost.observe(tokens, 0.1 + 0.002 * tokens)
    assert cost.fixed() == pytest.approx(0.1, rel=1e-9)
    # a small pass that compiled its shape (seconds): the line's fixed part is 1.42 s, but no
    # pass shows a fixed part above the cheapest one's 0.132 s
    cost.observe(8, 5.0)
    assert cost.fixed() == pytest.approx(0.1 + 0.002 * 16, rel=1e-9)


@pytest.mark.parametrize("pass_s, cycle_s, passes", [(1.0, 0.05, 3), (0.01, 1.0, 5)])
def test_rows_ending_a_cycle_apart_join_in_one_prefill_pass(
    pair, monkeypatch, pass_s, cycle_s, passes
):
    """Four slots, eight prompts; the first four end after 6, 8, 10 and 12 tokens, two cycles
    apart. Where a prefill pass costs 1 s (a scripted clock) and a cycle a tenth or so of one,
    a free slot waits for the next row to end rather than paying a pass of its own
    (engine/batch.py: ``_gather``): the last three prompts join in one pass, three passes in
    all (each join at once: five). Where a pass costs less than the empty slots' share of a
    cycle, each joins at once. Every row is the target's greedy decoding of its prompt."""
    from dflash_batch.engine import batch

    monkeypatch.setattr(prefill, "time", StepClock(pass_s))
    monkeypatch.setattr(batch, "time", StepClock(cycle_s))
    engine = load_engine(str(pair[0]), None, prefill_chunk=64, prefix_cache_mb=0)
    budgets = [6, 8, 10, 12, 12, 12, 12, 12]
    eos = engine.tokenizer.eos_token_ids
    # prompts whose greedy decoding has no EOS in its budget: the rows end at their budgets
    prompts = (_ids(12, seed) for seed in range(100))
    prompts = [p for p in prompts if len(greedy_reference(pair[0], p, 12, eos)) == 12][:8]
    refs = [greedy_reference(pair[0], p, n, eos) for p, n in zip(prompts, budgets)]
    out = engine.generate_batch(prompts, max_tokens=budgets, batch_size=4)
    assert [c.token_ids for c in out] == refs
    assert engine.prefill_counts["passes"] == passes, engine.prefill_counts


@pytest.mark.parametrize("count, rows", [(6, None), (8, 1)])
def test_no_wait_where_no_pass_is_saved(pair, monkeypatch, count, rows):
    """As above (a pass dear, cycles cheap), but six prompts: when the second row ends one
    request waits and the free slot takes it; or eight, with one prompt per pass
    (``prefill_rows`` 1): each join needs a pass of its own. Waiting for the next row to end
    would save no pass and only delay them: the batch never waits, and its passes, cycles and
    rows are those of never waiting."""
    from dflash_batch.engine import batch

    monkeypatch.setattr(prefill, "time", StepClock(1.0))
    monkeypatch.setattr(batch, "time", StepClock(0.05))
    engine = load_engine(str(pair[0]), None, prefill_chunk=64, prefix_cache_mb=0, prefill_rows=rows)
    budgets = [6, 8, 10, 12, 12, 12, 12, 12][:count]
    eos = engine.tokenizer.eos_token_ids
    # of two lengths: one-prompt passes of two sizes, from which the pass's fixed part is known
    prompts = (_ids(12 + 4 * (seed % 2), seed) for seed in range(100))
    prompts = [p for p in prompts if len(greedy_reference(pair[0], p, 12, eos)) == 12][:count]
    waited, real = [], batch.BatchDecoder._gather

    def spy(self):
        waited.append(real(self))
        return waited[-1]

    runs = []
    for gather in (spy, lambda self: False):
        monkeypatch.setattr(batch.BatchDecoder, "_gather", gather)
        out = engine.generate_batch(prompts, max_tokens=budgets, batch_size=4)
        cycles = sum(n for n, _, _ in engine.decode_counts.values())
        runs.append((engine.prefill_counts["passes"], cycles, [c.token_ids for c in out]))
    assert waited and not any(waited)
    assert runs[0] == runs[1], (runs[0][:2], runs[1][:2])
    assert runs[0][0] == (3 if rows is None else count)  # the first four together, or one each
