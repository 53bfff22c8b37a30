"""The width policy alone (engine/widths.py): fixed pass costs, scripted acceptance, no timing.

Issue 13's rule: a job is never more than 10% slower than plain batched decoding at the same
batch size. A simulated job charges each cycle the cost model's seconds for the width chosen;
each row accepts each draft with probability p, independently, until its first rejection."""

import math
import random
import statistics
from typing import List

from dflash_batch.engine import load_engine
from dflash_batch.engine.widths import (
    PROBE_WIDTH,
    TRUSTED,
    Acceptance,
    CostModel,
    NodeCalibration,
    WidthPolicy,
    expected_committed,
    pooled_acceptance,
)

import pytest

# Pass costs in units of a plain pass at batch 1 (t0 = 1). CPU: the target's cost grows with
# the rows verified and a draft pass costs a third of a target pass (as the default pair's
# warm-up measured on the 2-core VM); GPU: extra rows and the draft are nearly free.
CPU = dict(t0=1.0, t1=0.05, d0=0.3, d1=0.2, window=0)
GPU = dict(t0=1.0, t1=0.002, d0=0.15, d1=0.002, window=0)
BLOCK = 16


def simulate(costs: dict, p: float, rows: int, tokens: int, seed: int):
    """One job of ``rows`` prompts of ``tokens`` tokens each: (its cost / plain decoding's cost,
    the widths chosen)."""
    rng = random.Random(seed)
    cost = CostModel(**costs)
    policy = WidthPolicy(BLOCK, cost)
    live = [(policy.new_row(), tokens) for _ in range(rows)]
    spent, widths = 0.0, []
    while live:
        T = policy.width([e for e, _ in live], [n for _, n in live])
        widths.append(T)
        spent += cost.cycle(len(live), T)
        left = []
        for estimate, n in live:
            L = min(T, n)
            a = 0
            while a < L - 1 and rng.random() < p:  # drafts 1..a accepted, a + 1 rejected
                a += 1
            policy.accepted(estimate, a, L)
            if n > a + 1:
                left.append((estimate, n - a - 1))
        live = left
    plain = tokens * cost.cycle(rows, 1)  # every row commits one token per plain cycle
    return spent / plain, widths


def expected_ratio(costs, p, rows, tokens, seeds=40):
    return statistics.mean(simulate(costs, p, rows, tokens, seed)[0] for seed in range(seeds))


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("rows,tokens", [(1, 32), (8, 24), (8, 200)])
def test_a_failing_drafter_costs_at_most_a_tenth_more_than_plain_decoding(costs, rows, tokens):
    assert expected_ratio(costs, 0.1, rows, tokens) <= 1.1


@pytest.mark.parametrize("costs,rows,wide", [(GPU, 8, 12), (CPU, 1, 6)], ids=["gpu-b8", "cpu-b1"])
def test_a_good_drafter_gets_wide_blocks(costs, rows, wide):
    """p = 0.8: the best fixed width is 12 or 16 on the GPU costs (0.29x plain), 12 on the CPU
    costs at batch 1 (0.43x plain; 6 gives 0.47x)."""
    ratio, widths = simulate(costs, 0.8, rows, 200, seed=0)
    assert statistics.median(T for T in widths if T > 1) >= wide
    assert ratio < 0.6  # drafting pays: much faster than plain decoding
    assert expected_ratio(costs, 0.8, rows, 200, seeds=10) < 0.6


def test_plain_decoding_where_drafts_cannot_pay():
    """CPU costs at batch 8: even drafts that are always accepted lose to plain decoding, so the
    job starts plain (a neutral prior, not an optimistic one) and only probes."""
    ratio, widths = simulate(CPU, 1.0, 8, 24, seed=0)
    assert widths[0] == 1
    assert ratio <= 1.05


def test_acceptance_per_position():
    """A drafter right for runs but often wrong at its first token: position 1 is estimated low,
    later positions high; a position never verified takes the estimate of the one before it."""
    e = Acceptance(15, decay=1.0, prior_weight=1.0)
    for _ in range(6):
        e.update(0, 8)  # draft 1 rejected
    for _ in range(4):
        e.update(7, 8)  # all 7 drafts accepted
    p = e.probabilities()
    assert p[0] == pytest.approx((4 + 0.5) / (10 + 1))
    assert p[1] == pytest.approx((4 + p[0]) / (4 + 1))
    assert p[7] == pytest.approx(p[6]) and p[6] > 0.8  # draft 8 never verified
    assert expected_committed(p, 3) == pytest.approx([0.0, 1.0, 1 + p[0], 1 + p[0] + p[0] * p[1]])
    row = Acceptance(15)  # a row with no cycles of its own: the prior it is given
    assert row.probabilities(p) == pytest.approx(p)
    row.update(0, 2)
    assert row.probabilities(p)[0] == pytest.approx(2 * p[0] / 3)


def test_one_slow_drafting_cycle_does_not_stop_drafting():
    """The first drafting cycle of a process can take several passes' time (the old policy's
    learnt overhead then kept a batch-1 job plain for 60 cycles): a kind's overhead counts once it
    has 3 cycles; before that drafting cycles take the plain cycles' overhead."""
    cost = CostModel(t0=1.0, t1=0.05, d0=0.5)
    for _ in range(4):
        cost.observe(1, 1, cost.passes(1, 1) + 0.1)  # plain cycles: 0.1 beyond their pass
    cost.observe(1, 4, 6.0)  # one slow drafting cycle
    assert cost.overhead(True) == pytest.approx(0.1)
    policy = WidthPolicy(BLOCK, cost)
    row = policy.new_row()
    for _ in range(3):
        policy.accepted(row, 3, 4)  # the drafts are good
    assert policy.width([row], [100]) > 1
    cost.observe(1, 4, 1.8)
    cost.observe(1, 4, 1.9)
    assert cost.overhead(True) == pytest.approx(1.9 - cost.passes(1, 4))


def test_a_width_dearer_than_modelled_is_costed_as_it_ran():
    """Widths between the timed ones are read off a line, which a BLAS's quirks can make far too
    cheap (the default pair on a 2-core CPU: T = 12 dearer than T = 16). Once a width has run
    TRUSTED cycles at a batch size, its own cycles' excess costs it; before that, its kind's."""
    cost = CostModel(t0=1.0, window=16)
    cost.rows, cost.timed = 1, {1: 1.0, 4: 1.2, 16: 1.6}  # T = 12 read as 1.467 s
    policy = WidthPolicy(BLOCK, cost)
    row = policy.new_row()
    for acceptance in (row, policy.job):  # p_k about 0.8 at every position
        acceptance.seen, acceptance.kept = [1000.0] * (BLOCK - 1), [800.0] * (BLOCK - 1)
    assert policy.width([row], [100]) == 12
    for _ in range(TRUSTED - 1):
        cost.observe(1, 12, 2.5)
    assert policy.width([row], [100]) == 12  # not yet trusted: the drafting kind's median excess
    assert cost.cycle(1, 12) == pytest.approx(cost.passes(1, 12) + cost.overhead(True))
    cost.observe(1, 12, 2.5)
    assert cost.cycle(1, 12) == pytest.approx(2.5)
    assert (
        cost.overhead(True) == 0.0
    )  # a width read off the line does not make the others look dear
    assert cost.cycle(1, 16) == pytest.approx(cost.passes(1, 16))
    assert policy.width([row], [100]) != 12
    for _ in range(TRUSTED):
        cost.observe(1, 16, 1.7)  # a timed width's cycles: its kind's excess
    assert cost.overhead(True) == pytest.approx(0.1)
    assert cost.cycle(1, 8) == pytest.approx(cost.passes(1, 8) + 0.1)
    assert cost.cycle(2, 12) == pytest.approx(
        cost.passes(2, 12) + cost.overhead(True)
    )  # per batch size


def test_a_job_starts_from_what_the_jobs_before_it_learnt():
    """Passes where a drafter of unknown worth (p = 0.5) does not pay and a good one does. A job
    given the engine's pooled estimates, after earlier jobs accepted every draft, verifies the
    widest block its budget allows from its first cycle; a job starting from nothing decodes
    plainly."""
    cost = CostModel(t0=1.0, t1=0.2, d0=0.6, window=0)
    pooled = pooled_acceptance(BLOCK)
    earlier = WidthPolicy(BLOCK, cost, job=pooled)
    for _ in range(20):
        earlier.accepted(earlier.new_row(), BLOCK - 1, BLOCK)
    assert WidthPolicy(BLOCK, cost).width([Acceptance(BLOCK - 1)], [12]) == 1  # too short to probe
    later = WidthPolicy(BLOCK, cost, job=pooled)
    assert later.width([later.new_row()], [12]) == 12  # the whole budget


def test_a_long_job_probes_at_its_start():
    """A draft pass as dear as a target pass (a tiny target): at the neutral p_1 = 0.5 drafting
    cannot pay, at p = 1 it pays 7 times over. A job of 200-token rows probes at its first cycle
    (what the probe can lose is under 5% of the plain decoding ahead) and then drafts wide; a job
    of 10-token rows does not pay for a probe."""
    costs = dict(t0=1.0, t1=0.01, d0=1.0, d1=0.0, window=0)
    ratio, widths = simulate(costs, 1.0, 1, 200, seed=0)
    assert widths[0] > 1 and statistics.median(widths) == BLOCK
    assert ratio < 0.2
    assert simulate(costs, 1.0, 1, 10, seed=0)[1] == [1] * 10


def test_rows_about_to_end_are_not_probed():
    """A probe is due (a long run of plain cycles, the whole share) but every row has fewer
    tokens left than the probe's width: nothing it learnt could be drafted on, so no probe; the
    next rows with room get it."""
    cost = CostModel(t0=1.0, t1=0.01, d0=1.0, d1=0.0, window=0)
    policy = WidthPolicy(BLOCK, cost)
    rows = [policy.new_row() for _ in range(4)]
    policy.drafting.plain = 1e6
    assert [policy.width(rows, [n] * 4) for n in (3, 2, 1)] == [1, 1, 1]
    assert policy.width(rows, [40] * 4) == PROBE_WIDTH


def test_cost_fit_recovers_per_token_and_per_row_costs():
    """target(B, T) = t0 + t1 B T + t2 B: t2 is what a row costs whatever its width (reading its
    keys); a fit on B T alone would blame it on the constant and overrate wide blocks."""
    t0, t1, t2, d0, d1 = 0.002, 3e-5, 2e-4, 0.001, 5e-5
    points = {
        (B, T): t0 + t1 * B * T + t2 * B for B, T in [(1, 1), (1, 16), (64, 1), (64, 8), (64, 16)]
    }
    cost = CostModel.fit(points, {1: d0 + d1, 64: d0 + 64 * d1})
    for got, want in [(cost.t0, t0), (cost.t1, t1), (cost.t2, t2), (cost.d0, d0), (cost.d1, d1)]:
        assert got == pytest.approx(want, rel=1e-6)


def test_cost_fit_never_goes_negative():
    # costs that fall with width at batch 1 (noise) must not give a negative per-token cost
    cost = CostModel.fit({(1, 1): 0.010, (1, 16): 0.009, (8, 1): 0.012, (8, 16): 0.011}, {1: 0.003})
    assert min(cost.t0, cost.t1, cost.t2, cost.d0, cost.d1) >= 0
    assert cost.passes(8, 16) > 0


def test_timed_widths_override_the_line_at_the_timed_batch_size():
    """Verify cost on a GPU jumps where the attention kernel needs another tile of query rows; the
    policy reads the timed widths at the job's batch size (and interpolates between them)."""
    cost = CostModel(
        t0=0.010, t1=0.0, t2=0.0, rows=64, timed={1: 0.021, 4: 0.023, 8: 0.033, 16: 0.055}
    )
    assert cost.target(64, 8) == pytest.approx(0.033)
    assert cost.target(64, 12) == pytest.approx(0.044)  # halfway between 8 and 16
    assert cost.target(1, 8) == pytest.approx(0.010)  # batch 1: the line
    assert cost.target(32, 16) == pytest.approx(0.010 + 0.045 * 31 / 63)
    # a drafter accepted 4 or 12 drafts, alternately: a flat cost verifies the whole block, the
    # timed one (16 rows cost 2.6 times 1 row) a narrower one
    est = Acceptance(15)
    for k in range(30):
        est.update(4 if k % 2 else 12, 16)
    assert WidthPolicy(16, CostModel(t0=0.055, t1=0.0)).width([est] * 64, [200] * 64) == 16
    assert WidthPolicy(16, cost).width([est] * 64, [200] * 64) < 16


def test_width_tables_for_all_rows_at_once_equal_each_rows_own():
    """The width choice's tokens per width, computed for every row in one array pass
    (``widths._committed``), equal each row's own ``expected_committed`` summed, and an update
    written as two list passes keeps exactly the counts of the update as defined."""
    from dflash_batch.engine.widths import _committed

    rng = random.Random(5)
    for _ in range(200):
        block = rng.choice([2, 3, 4, 8, 16])
        policy = WidthPolicy(block, CostModel(**GPU))
        rows = [policy.new_row() for _ in range(rng.randint(1, 40))]
        for row in rows:
            for _ in range(rng.randint(0, 20)):
                verified = rng.randint(1, block)
                accepted = rng.randint(0, verified - 1)
                seen, kept = [0.9 * n for n in row.seen], [0.9 * n for n in row.kept]
                for k in range(min(accepted + 1, verified - 1, len(seen))) if verified > 1 else ():
                    seen[k] += 1.0
                    kept[k] += k < accepted
                policy.accepted(row, accepted, verified)
                if verified > 1:
                    assert (row.seen, row.kept) == (seen, kept)
        budgets = [rng.randint(1, 3 * block) for _ in rows]
        widths, job = policy.widths(max(budgets)), policy.job.probabilities()
        tables = [
            expected_committed(r.probabilities(job), min(widths[-1], n))
            for r, n in zip(rows, budgets)
        ]
        expected = [sum(t[min(T, len(t) - 1)] for t in tables) for T in widths]
        assert _committed(rows, budgets, job, widths) == pytest.approx(expected, rel=1e-12)


def _probes_of_a_drafter_that_turns(good_after: int, tokens: int, p_good: float = 0.9):
    """One row of ``tokens`` tokens on the CPU costs, whose drafts are all rejected for its first
    ``good_after`` tokens and accepted with p_good after: (cost / plain decoding's, widths)."""
    rng = random.Random(0)
    cost = CostModel(**CPU)
    policy = WidthPolicy(BLOCK, cost)
    row, left, spent, widths = policy.new_row(), tokens, 0.0, []
    while left > 0:
        T = policy.width([row], [left])
        widths.append(T)
        spent += cost.cycle(1, T)
        p = 0.0 if tokens - left < good_after else p_good
        a = 0
        while a < min(T, left) - 1 and rng.random() < p:
            a += 1
        policy.accepted(row, a, min(T, left))
        left -= a + 1
    return spent / (tokens * cost.cycle(1, 1)), widths


def test_a_drafter_that_keeps_failing_is_probed_ever_more_rarely():
    """Each probe after the first that does not lead to drafting halves the probe share (to 1/8):
    a drafter that never succeeds over 2000 tokens costs under 1.5% (24 probes; a fixed 5% share:
    154 probes, 4.8%)."""
    ratio, widths = _probes_of_a_drafter_that_turns(10**9, 2000)
    probes = sum(T > 1 for T in widths)
    assert probes <= 25, probes
    assert ratio <= 1.015, ratio


def _probes_per_job(policy_for_job, jobs: int, rows: int = 16, tokens: int = 128):
    """``jobs`` jobs one after another, each of ``rows`` rows of ``tokens`` tokens whose drafts
    are all rejected, on the CPU costs (drafting at 16 rows never pays there): each job a width
    policy of its own from ``policy_for_job(rows)``, as the engine makes one per job. The
    drafting probes each job ran, and its cost over plain decoding's."""
    probes, ratios = [], []
    for _ in range(jobs):
        policy = policy_for_job(rows)
        live = [(policy.new_row(), tokens) for _ in range(rows)]
        ran, spent = 0, 0.0
        while live:
            T = policy.width([e for e, _ in live], [n for _, n in live])
            ran += T > 1
            spent += policy.cost.cycle(len(live), T)
            for estimate, n in live:
                policy.accepted(estimate, 0, min(T, n))
            live = [(e, n - 1) for e, n in live if n > 1]
        probes.append(ran)
        ratios.append(spent / (tokens * policy.cost.cycle(rows, 1)))
    return probes, ratios


def test_a_drafter_that_keeps_failing_is_probed_ever_more_rarely_across_jobs(tiny_pair):
    """The engine keeps what its drafting probes spent from job to job (``DraftingProbes``), as
    it keeps the plain probes': a worker's jobs, each too short to back its probes off far,
    would otherwise each begin at the whole share and pay its first probes again. Twelve jobs
    of 128 cycles through one engine's width policies: the probes per job fall from the first
    job's to one in every few jobs (each job its own: two in every job), and the later
    jobs cost under 1% over plain decoding."""
    target, draft = map(str, tiny_pair)
    engine = load_engine(target, draft, cost_model=CostModel(**CPU), drafts="chain")
    probes, ratios = _probes_per_job(engine._width_policy, 12)
    assert probes[0] >= 2, probes  # the first job probes at its start and at the whole share
    # here 2, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0 (each job its own: 2 in every job)
    assert sum(probes[4:]) <= 3, probes
    assert sum(ratios[4:]) / len(ratios[4:]) <= 1.01, ratios
    assert engine.drafting_probes.failed >= 4  # backed off to the least share, kept
    # a new drafter starts afresh: nothing learnt of the old one's probes holds for it
    engine.use_drafter(None)
    assert engine.drafting_probes.failed == 0


def test_a_drafter_that_turns_good_is_still_found():
    """The share is only divided by 8 at most, and a probe whose drafts are all right restores
    it: a drafter that fails for 1000 tokens (1000 plain cycles) and then is right 90% of the
    time gets wide blocks within 200 cycles (here 103; a fixed 5% share: 41), and the job ends
    well under plain decoding's cost (0.68, as with a fixed share)."""
    ratio, widths = _probes_of_a_drafter_that_turns(1000, 2000)
    drafted_by_choice = [i for i, T in enumerate(widths) if T > 4]
    assert drafted_by_choice and drafted_by_choice[0] < 1200, drafted_by_choice[:1]
    assert ratio < 0.75, ratio


def _tree_rows(rng: random.Random, rows: int, nodes: int, sure: float):
    """Best-first prefixes of ``rows`` rows: depths of a chain of ``nodes`` with scores log(sure^d)
    less a little noise per node (a prefix never scores above its parent)."""
    out = []
    for _ in range(rows):
        depths, scores = [0], [0.0]
        for d in range(1, nodes + 1):
            depths.append(d)
            scores.append(scores[-1] + math.log(sure) - 0.05 * rng.random())
        out.append((depths, scores))
    return out


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("sure", [0.2, 0.6, 0.95])
def test_a_trees_width_maximises_what_its_nodes_are_expected_to_commit(costs, sure):
    """E_b(T) = 1 + the first min(T, budget_b) - 1 nodes' c_d * exp(score), rated against the
    cost model at each width, recomputed here by brute force."""
    rng = random.Random(7)
    policy = WidthPolicy(BLOCK, CostModel(**costs))
    for k in range(len(policy.nodes.predicted)):  # a calibration learnt: c_d = 0.5 .. 1.2
        policy.nodes.predicted[k], policy.nodes.accepted[k] = 10.0, 10.0 * (0.5 + 0.05 * k) - 1.0
    c = policy.nodes.scales()
    trees, budgets = _tree_rows(rng, 5, BLOCK - 1, sure), [16, 9, 3, 16, 1]

    def rate(T):
        tokens = sum(
            1 + sum(c[d[i] - 1] * math.exp(s[i]) for i in range(1, min(T, n, len(d))))
            for (d, s), n in zip(trees, budgets)
        )
        return tokens / policy.cost.cycle(len(budgets), T)

    chosen = policy.tree_width(trees, budgets)
    assert rate(chosen) == pytest.approx(max(rate(T) for T in policy.widths(16) if T > 1))


def test_sure_drafts_get_wide_trees_and_unsure_ones_narrow():
    rng = random.Random(0)
    policy = WidthPolicy(BLOCK, CostModel(**CPU))
    assert policy.tree_width(_tree_rows(rng, 1, BLOCK - 1, 0.95), [200]) == BLOCK
    assert policy.tree_width(_tree_rows(rng, 1, BLOCK - 1, 0.05), [200]) == 2
    assert (
        WidthPolicy(BLOCK, CostModel(**CPU), fixed=True).tree_width(
            _tree_rows(rng, 1, 15, 0.05), [200]
        )
        == BLOCK
    )


def test_node_calibration_learns_how_far_the_drafter_is_right():
    """A drafter over three times as sure of every node as it is right (the path reaches depth d with
    probability 0.3 * 0.8^d, it says 0.8^d): c_d comes to 0.3, and its trees narrow (counts decayed
    slowly here, so that the estimate is not noisy)."""
    rng = random.Random(3)
    policy = WidthPolicy(BLOCK, CostModel(**CPU), nodes=NodeCalibration(BLOCK - 1, decay=0.999))
    depths = list(range(BLOCK))
    scores = [d * math.log(0.8) for d in depths]
    trusting = policy.tree_width([(depths, scores)], [200])
    for _ in range(3000):
        u = rng.random()
        accepted = sum(1 for d in depths[1:] if u < 0.3 * 0.8**d)
        policy.tree_accepted(depths, scores, accepted)
    for c in policy.nodes.scales()[:8]:
        assert c == pytest.approx(0.3, abs=0.06)
    assert policy.tree_width([(depths, scores)], [200]) < trusting


def test_a_shrinking_batch_learns_what_an_untimed_width_costs():
    """Issue 36, finding 2, replayed: a GPU's warm-up timed widths 1, 8 and 16 at batch 32 and the
    line put the widths between far below what they cost (a drafting cycle of width 4 or 6 costs
    about 2.3 plain cycles, drafts a third accepted). Rows finish one by one, so a width never
    runs TRUSTED cycles at one live-row count, and untimed widths do not feed their kind's excess:
    costed per live-row count, the width policy drafted the whole job, over twice plain decoding's
    time. Costed per batch rung (the pass shape the cycles run at) it learns in the first rung.
    The rows' acceptance is scripted, the costs fixed: no timing."""
    cost = CostModel(t0=0.85, t1=0.0002, d0=0.3, window=16)
    cost.rows, cost.timed = 32, {1: 0.9, 8: 1.1, 16: 1.4}
    real = {1: 1.03, 8: 2.6, 16: 3.0}  # seconds a cycle of each width costs, the others 2.4
    rng = random.Random(0)
    policy = WidthPolicy(BLOCK, cost)
    live = [policy.new_row() for _ in range(32)]
    spent = plain = 0.0
    widths = []
    for c in range(64):
        if c > 1 and c % 2 == 0 and len(live) > 1:
            live.pop()  # a row finishes every other cycle
        T = policy.width(live, [64 - c] * len(live))
        spent += real.get(T, 2.4)
        widths.append(T)
        plain += real[1]
        cost.observe(len(live), T, real.get(T, 2.4))
        for row in live:
            a = 0
            while a < T - 1 and rng.random() < (0.5, 0.4, 0.3)[min(a, 2)]:
                a += 1
            policy.accepted(row, a, T)
    assert sum(T > 1 for T in widths[32:]) <= 2, widths  # plain once learnt, but for a probe
    assert spent <= 1.4 * plain  # the first rung's cycles learn what its widths cost


def _loaded_job(cost: CostModel, load: float, p: float, rows: int, cycles: int) -> List[int]:
    """A job of ``cycles`` cycles over ``rows`` rows on a machine whose load stretches every pass
    ``load`` times (each cycle runs that many times its modelled passes, and the cost model
    observes it), every draft position's acceptance known to be p (scripted, not learnt): the
    widths chosen."""
    policy = WidthPolicy(BLOCK, cost)
    live = [policy.new_row() for _ in range(rows)]
    for acceptance in live + [policy.job]:
        acceptance.seen, acceptance.kept = [1000.0] * (BLOCK - 1), [1000.0 * p] * (BLOCK - 1)
    widths = []
    for _ in range(cycles):
        T = policy.width(live, [100] * rows)
        widths.append(T)
        cost.observe(rows, T, load * cost.passes(rows, T))
    return widths


def test_under_load_drafting_is_not_priced_below_its_share_of_the_excess():
    """docs/results/never-loses.md, "Under load the width policy drafts where it does not pay",
    replayed: load stretches every pass by a factor, so the plain cycles' learnt excess grows in
    seconds, and the widths between the timed 1 and 16 borrow it until each has TRUSTED cycles
    of its own at the rung. Borrowed as seconds, a drafting cycle (several plain passes' cost on
    the CPU costs) was charged a plain cycle's stretch, and drafting at p = 0.6, which loses to
    plain decoding at any load, looked as if it paid: the job drafted at 4, 6, 3 and 8 in turn,
    TRUSTED cycles each. Charged at least the plain excess relative to its passes, it decodes
    plainly but for its probes."""
    costs = dict(CPU, window=16)
    cost, rows, load, p = CostModel(**costs), 4, 1.5, 0.6
    cost.rows, cost.timed = rows, {1: cost.target(rows, 1), 16: cost.target(rows, 16)}
    E = expected_committed([p] * (BLOCK - 1), BLOCK)
    plain = rows / (load * cost.passes(rows, 1))
    for T in range(2, BLOCK + 1):  # at this load every drafting width loses to plain decoding
        assert rows * E[T] / (load * cost.passes(rows, T)) < plain
    widths = _loaded_job(cost, load, p, rows, 64)
    assert sum(T > 1 for T in widths) <= 3, widths  # the probes (one every ~29 plain cycles)
    assert cost.overhead(True) == pytest.approx((load - 1) * cost.passes(rows, 1))  # borrowed


def test_a_borrowed_excess_prices_drafting_at_least_its_share_of_the_passes():
    """``CostModel.cycle`` (module doc, "Borrowed excess"): a drafting width without TRUSTED
    cycles of its own at the rung is charged the greater of the lender's median excess in
    seconds and its median excess relative to the lender's passes times its own passes; the
    plain kind keeps its seconds; a width's own cycles price it as they ran."""
    cost = CostModel(**dict(CPU, window=16))
    for _ in range(TRUSTED):
        cost.observe(4, 1, 1.5 * cost.passes(4, 1))  # plain cycles, every pass stretched 1.5x
    assert cost.overhead(True) == pytest.approx(0.5 * cost.passes(4, 1))
    assert cost.cycle(4, 1) == pytest.approx(1.5 * cost.passes(4, 1))  # its own
    # plain at another rung: the seconds, not the share
    assert cost.cycle(16, 1) == pytest.approx(cost.passes(16, 1) + 0.5 * cost.passes(4, 1))
    for T in (2, 4, 16):  # drafting passes dearer than the plain ones: stretched alike
        assert cost.cycle(4, T) == pytest.approx(1.5 * cost.passes(4, T))
    # the drafting kind's own cycles (no widths timed: every cycle is its kind's) lend to its
    # widths alike: a wider one its share, a narrower one the seconds
    for _ in range(TRUSTED):
        cost.observe(4, 4, 1.5 * cost.passes(4, 4))
    assert cost.cycle(4, 8) == pytest.approx(1.5 * cost.passes(4, 8))
    assert cost.cycle(4, 2) == pytest.approx(cost.passes(4, 2) + 0.5 * cost.passes(4, 4))
    # host work alone (a fixed excess): where the borrower's passes are the cheaper, the seconds
    fixed = CostModel(**dict(CPU, window=16))
    for _ in range(TRUSTED):
        fixed.observe(16, 1, fixed.passes(16, 1) + 0.5)
    assert fixed.passes(1, 2) < fixed.passes(16, 1)
    assert fixed.cycle(1, 2) == pytest.approx(fixed.passes(1, 2) + 0.5)
    share = 0.5 / fixed.passes(16, 1)
    assert fixed.cycle(16, 4) == pytest.approx(fixed.passes(16, 4) * (1 + share))
    for _ in range(TRUSTED):  # its own cycles: as they ran, below the share
        fixed.observe(16, 4, fixed.passes(16, 4) + 0.1)
    assert fixed.cycle(16, 4) == pytest.approx(fixed.passes(16, 4) + 0.1)


def test_a_wide_batch_backs_off_its_probes_though_some_row_gets_a_probe_right():
    """16 rows on the CPU costs whose drafts are accepted half the time (drafting does not pay
    there): in a probe of 3 drafts some row accepts all three by chance (12.5% a row, 88% a
    probe). A probe restores the whole share only where most of its rows got every draft right,
    so the probes back off as a lone row's do: 6 probes over 2000 cycles (when any one row
    restored it: 31)."""
    rng = random.Random(2)
    cost = CostModel(**CPU)
    policy = WidthPolicy(BLOCK, cost)
    rows = [policy.new_row() for _ in range(16)]
    probes = 0
    for _ in range(2000):
        T = policy.width(rows, [10**6] * len(rows))
        probes += T > 1
        for row in rows:
            a = 0
            while a < T - 1 and rng.random() < 0.5:
                a += 1
            policy.accepted(row, a, T)
    assert probes <= 12, probes


def test_cycles_well_below_their_timed_passes_mark_the_costs_stale():
    """Cycles at timed widths, plain or drafting, that ran well below their modelled passes say
    the timings were spiked; cycles at widths read between timed ones count too, held to their
    passes less INTERPOLATION of them (the tests below)."""
    cost = CostModel(t0=0.1, t1=0.01, d0=0.05, window=16, rows=8, timed={1: 0.2, 8: 0.4})
    for T in [1, 8, 1]:
        assert not cost.stale()  # fewer than TRUSTED cycles yet
        cost.observe(8, T, 0.5 * cost.passes(8, T))  # half its passes (the draft pass included)
    assert cost.stale()
    fresh = CostModel(t0=0.1, t1=0.01, d0=0.05, window=16, rows=8, timed={1: 0.2, 8: 0.4})
    for _ in range(TRUSTED):
        fresh.observe(8, 1, 0.21)  # a little host work above the pass: as it should be
        # an untimed width whose reading off the line is 20% dear: no sign of a spike
        fresh.observe(8, 4, 0.8 * fresh.passes(8, 4))
    assert not fresh.stale() and len(fresh.relative) == 2 * TRUSTED


def _scaled(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with every pass ``factor`` times as dear (a table timed under that much load)."""
    lines = {n: factor * getattr(cost, n) for n in ("t0", "t1", "t2", "d0", "d1")}
    timed = {T: factor * s for T, s in cost.timed.items()}
    return CostModel(**lines, window=cost.window, rows=cost.rows, timed=timed)


def _batch_12() -> CostModel:
    """A CPU's table at batch 12: widths 1 and 4 timed (engine/warmup.py), the others read off
    lines."""
    return CostModel(
        t0=0.1, t1=0.01, d0=0.05, d1=0.01, window=16, rows=12, timed={1: 0.25, 4: 0.55}
    )


@pytest.mark.parametrize("dear", [1.7, 2.4])
@pytest.mark.parametrize(
    "cycles",
    [[(12, 6), (12, 8), (12, 16), (12, 3)], [(9, 12), (7, 4), (5, 1), (11, 2)]],
    ids=["untimed widths", "fewer rows"],
)
def test_a_table_too_dear_throughout_is_stale_whatever_widths_the_job_runs(dear, cycles):
    """Last session's batch-12 table stayed: its job drafted at widths the table does not time
    (and at its tail ran fewer rows than the table's). Cycles there, each a little host work
    above what the passes really cost, now show a table priced ``dear`` times too high."""
    honest = _batch_12()
    table = _scaled(honest, dear)
    for B, T in cycles * 4:  # none is a width timed at the table's rows
        seconds = 1.02 * honest.passes(B, T)
        table.observe(B, T, seconds)
        honest.observe(B, T, seconds)
    assert table.stale()
    assert not honest.stale()  # the same cycles leave the honest table alone


@pytest.mark.parametrize("off", [0.15, 0.3])
def test_a_table_right_where_timed_is_not_stale_for_what_it_reads_between(off):
    """An honest table whose line between timed widths overprices a width by ``off`` (a GPU's
    tiles of query rows make the true costs a staircase) is not timed again, even by a job that
    drafts at that width alone: its cycles there run ``off`` below the modelled passes, and
    only ``STALE`` beyond INTERPOLATION marks a table stale."""
    cost = CostModel(t0=0.1, t1=0.01, d0=0.05, window=16, rows=12, timed={1: 0.25, 16: 1.0})
    for _ in range(40):
        cost.observe(12, 8, (1 - off) * cost.passes(12, 8))
    assert len(cost.relative) == 16 and not cost.stale()
