"""A job runs a handful of pass shapes, each compiled once: as rows finish, the batch shrinks to
sizes of a short ladder (engine/batch.py: ``shrink``, ``batch_rung``), keeping idle rows up to the
rung, not to one batch size per row that finished; and every verify pass runs at one of a few
bucket widths (engine/widths.py: ``buckets``), whatever the rows' budgets leave them. Shapes
are counted, nothing is timed."""

from __future__ import annotations

from dflash_batch.engine import load_engine
from dflash_batch.engine.batch import BatchDecoder, batch_rung
from dflash_batch.engine.widths import CostModel, WidthPolicy, bucket, buckets

import pytest

from tests.helpers import fixed_costs, greedy_reference, set_modes
from tests.scripting import ScriptedDrafts

LADDER = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}


def test_the_rungs_are_a_short_ladder_that_holds_the_rows():
    for rows in range(1, 65):
        assert batch_rung(rows) >= rows and batch_rung(rows) in LADDER
        assert batch_rung(rows) < 1.5 * rows or rows < 3  # an idle share under a third


def test_a_tail_of_rows_finishing_one_by_one_runs_few_batch_sizes(qwen3_target, monkeypatch):
    engine = load_engine(str(qwen3_target), None)
    sizes = []
    run = BatchDecoder.run

    def counted(self, width):
        sizes.append(self.slots)
        return run(self, width)

    monkeypatch.setattr(BatchDecoder, "run", counted)
    prompts = [engine.encode(f"Row {i}: count slowly") for i in range(20)]
    done = engine.generate_batch(prompts, max_tokens=[2 + i for i in range(20)], batch_size=20)
    assert [len(c.token_ids) for c in done] == [2 + i for i in range(20)]
    shapes = sorted(set(sizes))
    assert set(shapes) <= LADDER | {20}, (
        shapes
    )  # a row finishing every cycle shrinks 20, 15, 11, 8, 6, ... unbucketed


def test_the_buckets_are_the_widths_below_the_block_and_the_block():
    assert buckets(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert buckets(10) == [1, 2, 3, 4, 6, 8, 10]
    assert [bucket(T, 16) for T in range(1, 17)] == [
        1,
        2,
        3,
        4,
        6,
        6,
        8,
        8,
        12,
        12,
        12,
        12,
        16,
        16,
        16,
        16,
    ]


@pytest.mark.parametrize("longest", range(1, 40))
def test_the_width_policy_offers_the_buckets_up_to_the_one_that_holds_the_longest_budget(longest):
    widths = WidthPolicy(16, CostModel()).widths(longest)
    top = bucket(min(longest, 16), 16)
    assert widths == [w for w in buckets(16) if w <= top]


def _varied_job(target, drafter, monkeypatch, count: int = 14, **kw):
    """An engine (fixed costs: the widths chosen do not depend on the machine's load), ``count``
    prompts with budgets of 1 to 40 (most end inside a block), an EOS id that ends some rows early,
    their greedy outputs under it and scripted drafts (mostly right: wide blocks pay)."""
    engine = load_engine(
        str(target), str(drafter), cost_model=fixed_costs(), prefill_chunk=256, **kw
    )
    script = ScriptedDrafts(monkeypatch)
    ids = [
        engine.encode(f"Row {i} of the job: tell me about {'stones ' * (i % 4)}")
        for i in range(count)
    ]
    budgets = [1 + (11 * i) % 40 for i in range(count)]
    free = [greedy_reference(target, i, n) for i, n in zip(ids, budgets)]
    longest = max(range(count), key=lambda i: budgets[i])
    eos = {
        free[longest][len(free[longest]) // 2]
    }  # mid-row in the longest row, and wherever else it comes
    engine.tokenizer.eos_token_ids = eos
    refs = [greedy_reference(target, i, n, eos) for i, n in zip(ids, budgets)]
    for n, (i, ref) in enumerate(zip(ids, free)):
        script(i + ref + [0] * 16, p_wrong=(0.0, 0.1, 0.3)[n % 3], seed=n)
    return engine, ids, budgets, refs


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("drafts", ["chain", "tree"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_every_verify_pass_runs_at_a_bucket_width_and_output_stays_greedy(
    qwen3_target, qwen3_drafter, monkeypatch, batch_size, drafts, adaptive
):
    """Budgets of 1 to 40 end inside blocks of 16, so a pass as wide as the rows' limits would run
    at nearly any width, each a shape compiled anew on a GPU: the pass runs at the bucket that
    holds them instead (engine/widths.py: ``buckets``), and the rows commit what greedy
    decoding of the target writes, EOS and budget cuts inside a block included."""
    engine, ids, budgets, refs = _varied_job(
        qwen3_target, qwen3_drafter, monkeypatch, adaptive_block=adaptive
    )
    set_modes(monkeypatch, engine, drafts=drafts)
    done = engine.generate_batch(ids, max_tokens=budgets, batch_size=batch_size)
    for n, (c, ref) in enumerate(zip(done, refs)):
        assert c.token_ids == ref, f"row {n}"
    assert any(c.stop_reason == "eos" for c in done) and any(
        c.finish_reason == "length" for c in done
    )
    widths = set(engine.decode_counts)
    assert widths <= set(buckets(engine.block_size)), sorted(widths)
    assert max(widths) > 1  # it drafted
