"""The drafter's prompt context is deferred (engine/prefill.py, engine/batch.py: ``prompts``): a
joining prompt keeps its tapped rows, and the first cycle that drafts for the batch writes them
into the drafter's cache. A job decoded plainly never runs the drafter; one that starts drafting
late pays for each prompt once, holds the context a fresh pass over the row's tokens gives, and
its greedy output is the target's own (fp32, CPU), batched, with shared prefixes, for a qwen3 and
a hybrid qwen3_5 target, a DFlash v1 and a DFlash 2 drafter."""

from __future__ import annotations

import random

from dflash_batch.engine import batch, load_engine
from dflash_batch.engine.ops.batch_cache import Lengths
from dflash_batch.engine.widths import CostModel, WidthPolicy

import mlx.core as mx
import pytest

from tests import dflash2_models as d2
from tests import synthetic
from tests.helpers import greedy_reference
from tests.scripting import ScriptedDrafts

# drafting never pays: a drafter pass costs a million plain cycles, so no probe is ever worth it
NEVER_DRAFTS = CostModel(t0=1.0, t1=0.05, d0=1e6, window=0)


@pytest.fixture(scope="module", params=["qwen3-v1", "qwen35-v1", "qwen3-dflash2"])
def pair(request, tmp_path_factory):
    """(target folder, drafter folder) of one target kind and one drafter kind."""
    root = tmp_path_factory.mktemp(request.param)
    kind, drafter = request.param.split("-")
    cfg = (
        synthetic.tiny_qwen3_config()
        if kind == "qwen3"
        else synthetic.tiny_qwen3_5_config(layers=4)
    )
    target = synthetic.save_target(root / "t", cfg, seed=1)
    if drafter == "v1":
        draft = synthetic.save_drafter(
            root / "d", synthetic.drafter_config(cfg, block_size=8), seed=3
        )
    else:
        draft = d2.save_dflash2(root / "d", d2.dflash2_config(cfg, block_size=8), seed=3)
    return target, draft


def _ids(length: int, seed: int):
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(length)]


def _prompts():
    """Behind one 80-token instruction (a shared prefix at granularity 32), and two of their own."""
    instruction = _ids(80, seed=99)
    return [instruction + _ids(n, seed=n) for n in (5, 40, 1, 70)] + [
        _ids(9, seed=7),
        _ids(120, seed=8),
    ]


class _Late(WidthPolicy):
    """Plain cycles first, then every cycle drafts at ``width`` (at most what a row may commit)."""

    def __init__(self, block: int, plain: int, width: int):
        super().__init__(block, CostModel())
        self.plain, self.draft_width, self.cycles = plain, width, 0

    def width(self, estimates, budgets, tail=None):
        self.cycles += 1
        return 1 if self.cycles <= self.plain else min(self.draft_width, max(budgets))


def _late(engine, monkeypatch, plain: int, width: int = 0):
    """The engine's jobs decode ``plain`` cycles plainly, then draft at ``width`` (0: a block)."""
    width = min(width or engine.block_size, engine.block_size)
    monkeypatch.setattr(
        engine,
        "_width_policy",
        lambda slots, requests=(), waits=False: _Late(engine.block_size, plain, width),
    )


def _engine(pair, **kw):
    kw.setdefault("prefix_cache_mb", 64)
    kw.setdefault("prefix_granularity", 32)
    return load_engine(str(pair[0]), str(pair[1]), prefill_chunk=32, **kw)


def _spy_context(engine, monkeypatch):
    """The drafter's context writes outside its drafting passes: (rows, width) per call. Rows of
    one call are padded to its width; a ``prefill_tokens`` below two prompts makes one row a call."""
    rows = []
    real = engine.drafter.add_context

    def spy(context, cache):
        rows.append(context.shape[:2])
        return real(context, cache)

    monkeypatch.setattr(engine.drafter, "add_context", spy)
    return rows


def test_a_job_decoded_plainly_never_runs_the_drafter(pair, monkeypatch):
    """Where drafting never pays, the width policy decodes plainly: no drafter pass, not even over the
    prompts (before, every prefill pass wrote its rows' context into the drafter's cache)."""
    engine = _engine(pair, cost_model=NEVER_DRAFTS)
    written = _spy_context(engine, monkeypatch)
    passes = []
    real = engine.drafter.draft_pass
    monkeypatch.setattr(
        engine.drafter, "draft_pass", lambda *a, **kw: passes.append(1) or real(*a, **kw)
    )
    prompts = _prompts()
    out = engine.generate_batch(prompts, max_tokens=12, batch_size=3)
    assert set(engine.decode_counts) == {1}  # plain cycles only
    assert written == [] and passes == []
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [greedy_reference(pair[0], p, 12, eos) for p in prompts]


def test_the_first_drafting_cycle_writes_each_prompt_once(pair, monkeypatch):
    """Four plain cycles, then drafting: no context is written before the first drafting cycle,
    which writes the prompts of the rows in flight; the rows that join later are written by the
    next drafting cycle; every prompt once (its whole length, or the rest of a shared prefix
    copied with it: both its tapped rows)."""
    engine = _engine(pair, prefill_tokens=64)  # one prompt per context write
    _late(engine, monkeypatch, plain=4)
    written = _spy_context(engine, monkeypatch)
    cycles = []
    real = batch.BatchDecoder.run

    def run(decoder, width):
        cycles.append((width, sum(n for _, n in written)))
        return real(decoder, width)

    monkeypatch.setattr(batch.BatchDecoder, "run", run)
    prompts = _prompts()
    out = engine.generate_batch(prompts, max_tokens=40, batch_size=3)
    assert [n for width, n in cycles[:5]] == [
        0
    ] * 5  # nothing before the first drafting cycle had run
    assert cycles[4][0] > 1 and cycles[5][1] > 0
    assert {rows for rows, _ in written} == {1} and sorted(n for _, n in written) == sorted(
        len(p) for p in prompts
    )
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [greedy_reference(pair[0], p, 40, eos) for p in prompts]


# (plain cycles, budgets, batch size): rows joining while others draft; and a batch that shrinks
# (two rows finish) while the other rows' prompts still wait to be written
CASES = {"joining": (3, [9, 30, 14, 6, 25, 11], 3), "shrinking": (10, [3, 2, 30, 25, 0, 0], 4)}


@pytest.mark.parametrize("case", list(CASES))
def test_late_drafting_context_equals_a_fresh_pass(pair, monkeypatch, case):
    """At every drafting cycle, each row's drafter cache holds the context a fresh target pass over
    its prompt and committed tokens gives, at its own positions: the prompt's rows first (written
    late, from a shared prefix or not), then every cycle's kept rows (a prompt written after the
    cycles' rows, or twice, or at another slot after the batch shrank, fails this)."""
    plain, budgets, batch_size = CASES[case]
    prompts = [p for p, n in zip(_prompts(), budgets) if n]
    budgets = [n for n in budgets if n]
    engine = _engine(pair)
    _late(engine, monkeypatch, plain=plain, width=4)
    target, drafter = engine.target, engine.drafter
    checked = []
    real = batch.BatchDecoder.draft

    def draft(decoder, last, rows, candidates=0):
        out = real(decoder, last, rows, **({"candidates": candidates} if candidates else {}))
        mx.eval(out, [c.arrays() for c in decoder.draft_cache])
        for b, row in enumerate(decoder.rows):
            if row is None:
                continue
            n = decoder.lengths.host[b]
            assert decoder.draft_lengths.host[b] == n  # every committed token but the newest
            tokens = (row.request.ids + row.history)[:n]
            _, hidden = target(mx.array([tokens]), target.make_cache(Lengths([0])))
            lengths = Lengths([0])
            fresh = drafter.make_cache(lengths)
            drafter.add_context(hidden, fresh)
            for big, small in zip(decoder.draft_cache, fresh):
                got, want = big.keys[b, :, :n], small.keys[0, :, :n]
                assert mx.allclose(
                    got, want, atol=2e-4 * max(mx.abs(want).max().item(), 1.0)
                ).item(), (b, n)
            checked.append(n)
        return out

    monkeypatch.setattr(batch.BatchDecoder, "draft", draft)
    shrunk = []
    keep = batch.BatchDecoder._keep
    monkeypatch.setattr(
        batch.BatchDecoder,
        "_keep",
        lambda decoder, slots: shrunk.append(len(decoder.prompts)) or keep(decoder, slots),
    )
    out = engine.generate_batch(prompts, max_tokens=budgets, batch_size=batch_size)
    assert len(checked) >= len(prompts) - 2
    if case == "shrinking":
        assert shrunk and shrunk[0] >= 2  # rows whose prompts still waited moved to other slots
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [
        greedy_reference(pair[0], p, n, eos) for p, n in zip(prompts, budgets)
    ]


def test_a_control_rows_prompt_is_never_written(pair, monkeypatch):
    """Control rows (decoded plainly in a drafting batch: their drafts are never verified) never
    have their prompt's context written; the other rows' are, once each."""
    from dflash_batch.request import Options, Request

    engine = _engine(pair, prefix_cache_mb=0, prefill_tokens=64)  # one prompt per context write
    _late(engine, monkeypatch, plain=2)
    written = _spy_context(engine, monkeypatch)
    prompts = _prompts()[:4]
    requests = [
        Request(f"r{i}", p, Options(max_tokens=20), control=i in (1, 2))
        for i, p in enumerate(prompts)
    ]
    done = {r.id: c for r, c in engine.generate_requests(requests, batch_size=4)}
    assert sorted(written) == sorted([(1, len(prompts[0])), (1, len(prompts[3]))])
    eos = engine.tokenizer.eos_token_ids
    for r, p in zip(requests, prompts):
        assert done[r.id].token_ids == greedy_reference(pair[0], p, 20, eos), r.id


@pytest.mark.parametrize("batch_size", [1, 3])
def test_late_drafting_is_lossless_with_cuts_inside_blocks(pair, monkeypatch, batch_size):
    """Drafts right from the first drafting cycle (scripted, tests/scripting.py), which comes after
    five plain cycles: whole blocks are accepted, so an EOS and budgets end rows inside a block.
    Output equals mlx-lm's greedy decoding of each prompt alone."""
    engine = _engine(pair)
    _late(engine, monkeypatch, plain=5)
    prompts = _prompts()
    budgets = [13, 30, 9, 21, 17, 26]  # a drafting block crosses 9 (and 13 at a block of 8)
    refs = [greedy_reference(pair[0], p, 30, ()) for p in prompts]
    k = next(
        i for i in range(8, len(refs[1])) if refs[1][i] not in refs[1][:i]
    )  # mid-block, past the plain cycles
    eos = {refs[1][k]}
    engine.tokenizer.eos_token_ids = eos
    script = ScriptedDrafts(monkeypatch)
    for p, ref in zip(prompts, refs):
        script(p + ref + [0] * 16, p_wrong=0.0)
    out = engine.generate_batch(prompts, max_tokens=budgets, batch_size=batch_size)
    want = [greedy_reference(pair[0], p, n, eos) for p, n in zip(prompts, budgets)]
    assert [c.token_ids for c in out] == want
    assert out[1].token_ids == refs[1][:k] and out[1].stop_reason == "eos"
    assert max(engine.decode_counts) > 1  # it drafted


def test_pending_context_is_bounded(pair, monkeypatch):
    """Past ``PENDING_PASSES`` passes' worth of rows (``prefill_tokens`` each), pending context is
    written into the drafter's cache while decoding stays plain: the prompts' rows, then the
    cycles' pieces; output unchanged."""
    monkeypatch.setattr(batch, "PENDING_PASSES", 1)
    engine = _engine(pair, cost_model=NEVER_DRAFTS, prefill_tokens=100)
    written = _spy_context(engine, monkeypatch)
    most = []
    real = batch.BatchDecoder.run

    def run(decoder, width):
        steps = real(decoder, width)
        most.append(decoder._held())
        return steps

    monkeypatch.setattr(batch.BatchDecoder, "run", run)
    prompts = _prompts()
    out = engine.generate_batch(prompts, max_tokens=60, batch_size=3)
    assert set(engine.decode_counts) == {1} and written
    assert max(most) <= 100 + 3  # the bound, and the cycle's own rows
    eos = engine.tokenizer.eos_token_ids
    assert [c.token_ids for c in out] == [greedy_reference(pair[0], p, 60, eos) for p in prompts]


def test_drafter_prefill_benchmark_smoke(tmp_path):
    """``benchmarks.drafter_prefill --smoke``: the engine that never drafts writes no prompt
    context; the one that drafts every cycle writes every prompt's, once."""
    import json

    from benchmarks import drafter_prefill

    path = drafter_prefill.main(["--smoke", "--out", str(tmp_path), "--machine", "test"])
    doc = json.loads(path.with_suffix(".json").read_text())
    engines = doc["engines"]
    assert engines["never"]["context_rows"] == engines["plain"]["context_rows"] == 0
    assert engines["drafting"]["context_rows"] == doc["prompts"] * doc["context"]
    assert (
        set(engines["never"]["cycles"]) == {"1"}
        and max(map(int, engines["drafting"]["cycles"])) > 1
    )
