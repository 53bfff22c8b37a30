"""A pass shape's first run compiles on a GPU (engine/widths.py, "What a new shape costs"): the
width policy charges a width not yet run at the batch's rows its compile, spread over the cycles
the job has left at it, and the batch's tail shrinks to a rung only where the rows it drops save
more than that. Costs are given (a compile estimate and pass costs), nothing is timed."""

from __future__ import annotations

from dflash_batch.engine import load_engine
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.widths import CompileCost, CostModel, WidthPolicy

import pytest

from tests.helpers import greedy_reference

BLOCK = 16
GPU = dict(t0=1.0, t1=0.002, d0=0.15, d1=0.002, window=0)  # extra rows and the draft nearly free
# a drafter pass three target passes dear: drafting never pays, only probes draft
DEAR_DRAFTS = dict(t0=1.0, t1=0.002, d0=3.0, d1=0.0, window=0)


def _good_rows(policy: WidthPolicy, rows: int):
    estimates = [policy.new_row() for _ in range(rows)]
    for acceptance in estimates + [policy.job]:  # p_k about 0.8 at every position
        acceptance.seen, acceptance.kept = [1000.0] * (BLOCK - 1), [800.0] * (BLOCK - 1)
    return estimates


@pytest.mark.parametrize("budget,new", [(40, False), (4000, True)])
def test_a_new_width_is_chosen_only_where_its_compile_pays(budget, new):
    """Widths 1 and 4 have run at these rows, the wider ones not: a compile of 20 plain passes'
    time does not pay over a job with 40 tokens a row left, and does over one with 4000."""
    policy = WidthPolicy(BLOCK, CostModel(**GPU), compile=CompileCost(prior=20.0, learns=False))
    policy.new_shape = lambda T: T not in (1, 4)
    rows = _good_rows(policy, 8)
    assert (policy.width(rows, [budget] * 8) > 4) == new
    free = WidthPolicy(BLOCK, CostModel(**GPU))  # no compile charged: the wide width either way
    free.new_shape = policy.new_shape
    assert free.width(_good_rows(free, 8), [budget] * 8) > 4


def _probes(policy: WidthPolicy, rows: int = 8, cycles: int = 400) -> list:
    """The widths of the probes a drafter that fails every draft gets over ``cycles`` cycles."""
    estimates = [policy.new_row() for _ in range(rows)]
    probes = []
    for _ in range(cycles):
        T = policy.width(estimates, [200] * rows)
        if T > 1:
            probes.append(T)
            for row in estimates:  # every first draft rejected
                policy.accepted(row, 0, T)
    return probes


def test_a_probe_runs_at_a_width_whose_pass_has_compiled():
    """Drafting never pays here; the warm-up timed (so compiled) widths 1, 8 and 16 at these rows.
    Where a new shape compiles, every probe runs at 8, not at PROBE_WIDTH (4): its compile costs
    many probes' bound. On a CPU (K = 0) the probes run at 4."""
    gpu = WidthPolicy(
        BLOCK, CostModel(**DEAR_DRAFTS), compile=CompileCost(prior=20.0, learns=False)
    )
    gpu.new_shape = lambda T: T not in (1, 8, 16)
    probes = _probes(gpu)
    assert probes and set(probes) == {8}
    cpu = WidthPolicy(BLOCK, CostModel(**DEAR_DRAFTS))
    cpu.new_shape = gpu.new_shape
    assert set(_probes(cpu)) == {4}


def test_a_probe_that_would_compile_counts_its_compile_in_what_it_can_lose():
    """No drafting width has run at these rows: the probes run at PROBE_WIDTH, rarer by what
    its compile adds to what each can lose."""
    gpu = WidthPolicy(
        BLOCK, CostModel(**DEAR_DRAFTS), compile=CompileCost(prior=20.0, learns=False)
    )
    gpu.new_shape = lambda T: T > 1
    free = WidthPolicy(BLOCK, CostModel(**DEAR_DRAFTS))
    free.new_shape = gpu.new_shape
    compiling, eager = _probes(gpu, cycles=8000), _probes(free, cycles=8000)
    assert set(compiling) == {4} and 0 < len(compiling) < len(eager) / 3


def test_what_a_compile_costs_is_learnt_from_new_shapes_first_cycles():
    gpu = CompileCost(prior=0.05)
    assert gpu.estimate() == pytest.approx(0.05)
    gpu.observe(0.15)
    gpu.observe(-0.01)  # a new shape's cycle quicker than modelled: compiled nothing
    assert gpu.estimate() == pytest.approx((0.05 + 0.15 + 0.0) / 3)
    eager = CompileCost(learns=False)  # a CPU's eager passes: nothing compiles
    eager.observe(0.3)
    assert eager.estimate() == 0.0


def test_on_the_cpu_eager_passes_charge_no_compile(qwen3_target, qwen3_drafter):
    engine = load_engine(str(qwen3_target), str(qwen3_drafter))
    assert engine.compile_cost.estimate() == 0.0 and not engine.compile_cost.learns


def _job(target, drafter, monkeypatch, cost: CostModel):
    """8 rows finishing one after another at batch 8, a compile of 5 plain passes charged
    (learning nothing from this CPU's cycles): the batch sizes the cycles ran at, and whether the
    rows wrote what greedy decoding of the target writes."""
    engine = load_engine(str(target), str(drafter), cost_model=cost, prefill_chunk=256)
    engine.compile_cost = CompileCost(prior=5.0, learns=False)
    sizes = []
    run = BatchDecoder.run

    def counted(self, width):
        sizes.append(self.slots)
        return run(self, width)

    monkeypatch.setattr(BatchDecoder, "run", counted)
    ids = [engine.encode(f"Row {i}: count slowly") for i in range(8)]
    budgets = [3 + 4 * i for i in range(8)]
    done = engine.generate_batch(ids, max_tokens=budgets, batch_size=8)
    greedy = all(
        c.token_ids == greedy_reference(target, i, n) for c, i, n in zip(done, ids, budgets)
    )
    return set(sizes), greedy


def test_a_launch_bound_batch_keeps_its_rows_rather_than_compile_a_rung(
    qwen3_target, qwen3_drafter, monkeypatch
):
    """Rows cost next to nothing (a tiny model on a GPU): dropping them saves less than the new
    rung's compile, so the batch stays at 8 rows to the end."""
    sizes, greedy = _job(
        qwen3_target, qwen3_drafter, monkeypatch, CostModel(t0=1.0, t1=0.0, d0=0.5, window=0)
    )
    assert greedy and sizes == {8}


def test_a_row_bound_batch_shrinks_where_the_rows_dropped_pay_for_the_rung(
    qwen3_target, qwen3_drafter, monkeypatch
):
    sizes, greedy = _job(
        qwen3_target, qwen3_drafter, monkeypatch, CostModel(t0=1.0, t2=1.0, d0=0.5, window=0)
    )
    assert greedy and min(sizes) < 8
