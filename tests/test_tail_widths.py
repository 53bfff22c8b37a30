"""The job's tail (engine/widths.py, "The job's tail"): once no request can join, the width policy
chooses the width that finishes every row soonest, not the one of most tokens per second. Costs
are scripted, acceptance seeded, nothing is timed.

Issue 36's finding, replayed: the default pair on an H100 at batch 32, one batch of 32 chat
prompts of 64 tokens: the rate favoured drafting by a few percent, the rows then finished
raggedly, and a cycle of 9 rows cost what one of 32 did: the job took 1.37 times plain decoding's
time."""

import math
import random
import statistics

from dflash_batch.engine import finish, load_engine, widths
from dflash_batch.engine.widths import (
    CompileCost,
    CostModel,
    WidthPolicy,
    expected_committed,
)

import pytest

from tests.helpers import greedy_reference

BLOCK = 16
# a launch-bound GPU: rows nearly free, a drafting cycle of width 6 about 1.6 plain cycles
GPU = dict(t0=1.0, t1=0.001, d0=0.4, d1=0.001, window=0)
# a CPU: a cycle's cost proportional to its rows
CPU = dict(t0=0.02, t1=0.05, t2=0.1, d0=0.01, d1=0.1, window=0)


def job(
    costs: dict, p: float, seed: int, tail: bool, rows: int = 32, tokens: int = 64, widths=None
):
    """One batch of ``rows`` rows of ``tokens`` tokens, none waiting: row b accepts each draft with
    its own probability, drawn around p; the width policy told it is the tail (``tail``) or not.
    Its cost over plain decoding's (every row one token a cycle, all finishing together); the
    widths chosen are appended to ``widths``."""
    rng = random.Random(seed)
    cost = CostModel(**costs)
    policy = WidthPolicy(BLOCK, cost)
    live = [(policy.new_row(), tokens, min(max(rng.gauss(p, 0.1), 0.0), 0.98)) for _ in range(rows)]
    spent = 0.0
    while live:
        budgets = [n for _, n, _ in live]
        T = policy.width([e for e, _, _ in live], budgets, budgets if tail else None)
        spent += cost.cycle(len(live), T)
        if widths is not None:
            widths.append(T)
        left = []
        for estimate, n, q in live:
            L, a = min(T, n), 0
            while a < L - 1 and rng.random() < q:  # drafts 1..a accepted, a + 1 rejected
                a += 1
            policy.accepted(estimate, a, L)
            if n > a + 1:
                left.append((estimate, n - a - 1, q))
        live = left
    return spent / (tokens * cost.cycle(rows, 1))


def mean_ratio(costs, p, tail, seeds=20):
    return statistics.mean(job(costs, p, seed, tail) for seed in range(seeds))


def test_the_findings_costs_favour_drafting_by_a_few_percent_a_cycle():
    cost = CostModel(**GPU)
    E = expected_committed([0.4] * (BLOCK - 1), BLOCK)
    rates = {T: E[T] / cost.cycle(32, T) * cost.cycle(32, 1) for T in (2, 3, 4, 6, 8)}
    assert 1.03 < max(rates.values()) < 1.1, rates
    assert cost.cycle(32, 6) == pytest.approx(1.6 * cost.cycle(32, 1), rel=0.05)


def test_at_the_tail_a_drafter_that_pays_by_the_rate_does_not_make_the_job_slower():
    """p about 0.4: weighed by the rate alone (the negative control) the job is slower than plain
    decoding; weighed by the time to finish every row, within 2% of it."""
    assert mean_ratio(GPU, 0.4, tail=False) > 1.05
    assert mean_ratio(GPU, 0.4, tail=True) <= 1.02


def test_at_the_tail_a_good_drafter_still_drafts_and_wins():
    """p about 0.9: wide blocks finish every row far sooner, as by the rate."""
    tail, rate = mean_ratio(GPU, 0.9, tail=True), mean_ratio(GPU, 0.9, tail=False)
    assert tail < 0.65
    assert tail <= 1.05 * rate


@pytest.mark.parametrize("p", [0.4, 0.7, 0.9])
def test_where_a_cycle_costs_in_proportion_to_its_rows_the_tail_keeps_the_rates_choice(p):
    """A CPU: the time to finish every row is about the sum of the rows' cycles, which the rate
    weighs already; the two choices end the job within 3% of each other."""
    tail, rate = mean_ratio(CPU, p, tail=True), mean_ratio(CPU, p, tail=False)
    assert tail == pytest.approx(rate, rel=0.03)


@pytest.mark.parametrize("p", [0.0, 0.3, 0.5])
def test_at_the_tail_a_plain_choice_stands_while_nothing_is_learnt(p, monkeypatch):
    """In plain cycles the budgets only fall, which at the tail too never makes drafting pay
    better (engine/widths.py): the widths chosen are those of weighing every cycle."""
    for costs in (GPU, CPU):
        stood = []
        job(costs, p, 0, tail=True, rows=8, tokens=200, widths=stood)
        with monkeypatch.context() as m:
            m.setattr(widths, "REPLAN", 0)  # weigh every cycle
            every = []
            job(costs, p, 0, tail=True, rows=8, tokens=200, widths=every)
        assert stood == every and stood.count(1) > 100


def _rows(rng: random.Random, policy: WidthPolicy, count: int):
    rows = [policy.new_row() for _ in range(count)]
    for row in rows:
        q = rng.random()
        for _ in range(rng.randint(0, 12)):
            verified = rng.randint(2, BLOCK)
            a = 0
            while a < verified - 1 and rng.random() < q:
                a += 1
            policy.accepted(row, a, verified)
    return rows


def test_one_row_at_the_tail_chooses_what_the_rate_chooses():
    """z = 0 for one row: n / E(T) cycles of cost(1, T), and a new shape's compile once, is its
    budget over the rate (the compile spread over those cycles): the same width, the tail's own
    weighing (``_soonest``) included."""
    rng = random.Random(11)
    for _ in range(300):
        costs = rng.choice([GPU, CPU, dict(t0=1.0, t1=0.2, d0=0.6, window=0)])
        policy = WidthPolicy(BLOCK, CostModel(**costs), compile=CompileCost(prior=rng.random()))
        unrun = set(rng.sample([2, 3, 4, 6, 8, 12, 16], 3))
        policy.new_shape = lambda T: T in unrun
        (row,), n = _rows(rng, policy, 1), rng.randint(2, 300)
        widths = policy.widths(n)
        rate, _ = policy._best_width([row], [n], n)
        assert policy._soonest([row], [n], [n], widths) == rate
        assert policy._best_width([row], [n], n, [n])[0] == rate


@pytest.mark.parametrize("costs", [GPU, CPU], ids=["gpu", "cpu"])
@pytest.mark.parametrize("p", [0.1, 0.4, 0.9])
def test_a_job_of_one_row_runs_the_same_widths_told_it_is_the_tail_or_not(costs, p):
    """Probes included: a probe at one row's tail brings its end closer as anywhere."""
    told, not_told = [], []
    job(costs, p, 3, tail=True, rows=1, tokens=300, widths=told)
    job(costs, p, 3, tail=False, rows=1, tokens=300, widths=not_told)
    assert told == not_told


class _Known:
    """A row whose every draft is accepted with probability p (a known drafter)."""

    def __init__(self, p: float):
        self.p = p

    def probabilities(self, prior):
        return [self.p] * (BLOCK - 1)


def test_the_last_rows_finish_is_foreseen():
    """32 rows alike, width 6 every cycle, a cycle's cost 1 whatever its rows: the last row's
    finish foreseen within 5% of its mean over 200 seeded jobs; plain decoding's exactly."""
    rows, n, p = 32, 64, 0.6
    pair = [1, 6]  # the widths compared
    moments = finish.moments([_Known(p)] * rows, [n] * rows, [], pair)
    z = finish.order_statistics(rows)
    plain, six = (
        finish.finish_time(lambda live: 1.0, T, m, [n] * rows, [n] * rows, z)
        for T, m in zip(pair, moments)
    )
    assert plain == n
    rng, ends = random.Random(0), []
    for _ in range(200):
        cycles = []
        for _ in range(rows):
            left, c = n, 0
            while left > 0:
                a = 0
                while a < min(6, left) - 1 and rng.random() < p:
                    a += 1
                left, c = left - a - 1, c + 1
            cycles.append(c)
        ends.append(max(cycles))
    assert six == pytest.approx(statistics.mean(ends), rel=0.05)


def test_the_expected_maximum_of_normals():
    """Clark's fold: exact for two normals (E[max] of two standard ones: 1 / sqrt(pi)), near
    Blom's for many alike, and a row far behind the rest finishes at its own mean."""
    assert finish.expected_max([(0.0, 1.0), (0.0, 1.0)]) == pytest.approx(1 / math.sqrt(math.pi))
    for rows in (4, 16, 32, 64):
        blom = finish.order_statistics(rows)[-1]
        assert finish.expected_max([(0.0, 1.0)] * rows) == pytest.approx(blom, rel=0.03)
    assert finish.expected_max([(0.0, 1.0)] * 31 + [(50.0, 1.0)]) == pytest.approx(50.0)
    assert finish.expected_max([(3.0, 0.0), (5.0, 0.0), (4.0, 0.0)]) == 5.0


def test_the_decoder_says_when_the_jobs_end_is_in_sight(
    tiny_pair, chain_drafts, joins_at_once, monkeypatch
):
    """6 prompts at batch 2: while more wait than there are rows the width policy weighs the rate
    (no ``tail``); in the last wave (two waiting, each to take a slot a row frees) it is given
    each slot's tokens left, the waiting requests' budgets included; once the last has joined,
    each row's tokens left. Greedy decoding stays exact. Each free slot takes a waiting request
    at once (``joins_at_once``): on measured seconds, on a loaded machine, a slot once waited
    for a later join in the last wave, where one live row and two waiting are not the tail."""
    target, drafter = map(str, tiny_pair)
    engine = load_engine(target, drafter, cost_model=CostModel(t0=1.0, d0=0.1, window=0))
    seen = []
    width = WidthPolicy.width

    def told(self, estimates, budgets, tail=None):
        seen.append(None if tail is None else sum(tail) - sum(budgets))
        return width(self, estimates, budgets, tail)

    monkeypatch.setattr(WidthPolicy, "width", told)
    ids = [engine.encode(f"Row {i}: count slowly") for i in range(6)]
    budgets = [5 + 3 * i for i in range(6)]
    done = engine.generate_batch(ids, max_tokens=budgets, batch_size=2)
    assert [c.token_ids for c in done] == [
        greedy_reference(tiny_pair[0], i, n) for i, n in zip(ids, budgets)
    ]
    first = next(i for i, s in enumerate(seen) if s is not None)
    assert first > 0 and None not in seen[first:]
    # the last wave: the waiting requests' budgets on top; then none waits
    assert seen[first] > 0 and seen[-1] == 0


def _decoder(waiting, joiners=(), urgent=None, done=True, closed=False, ends=None, empty=0):
    """What ``BatchDecoder._tail`` reads of a decoder: requests of these budgets waiting (the
    stream ``done`` or not), the prompts joining, an interactive source, whether the batch is
    closed, how the engine's rows end, and how many of its slots are empty."""
    from types import SimpleNamespace

    from dflash_batch.engine.batch import EncodedRequest
    from dflash_batch.engine.finish import Ends
    from dflash_batch.engine.waiting import Waiting

    queue = Waiting([[EncodedRequest([1, 2], max_tokens=n)] for n in waiting])
    queue.peek()
    queue.done = done
    return SimpleNamespace(
        waiting=queue,
        group=SimpleNamespace(joiners=list(joiners)),
        urgent=urgent,
        _closed=lambda: closed,
        engine=SimpleNamespace(ends=ends if ends is not None else Ends()),
        rows=[None] * empty,  # the live rows are passed to ``_tail``; only the empty slots are read
    )


def test_in_the_last_wave_the_rows_that_finish_first_take_the_waiting_requests():
    """Rows with 9, 3 and 6 tokens left, two requests waiting of 20 and 10: the row with 3 left
    takes the first, the one with 6 the second. More waiting than rows, a stream not yet ended,
    a prompt joining or an interactive request to come: not the last wave."""
    from types import SimpleNamespace

    from dflash_batch.engine.batch import BatchDecoder

    rows = [SimpleNamespace(budget=n) for n in (9, 3, 6)]
    assert BatchDecoder._tail(_decoder([20, 10]), rows) == [9, 23, 16]
    assert BatchDecoder._tail(_decoder([20, 10, 5]), rows) == [14, 23, 16]
    assert BatchDecoder._tail(_decoder([20, 10, 5, 1]), rows) is None
    assert BatchDecoder._tail(_decoder([20], done=False), rows) is None
    assert BatchDecoder._tail(_decoder([20], joiners=[object()]), rows) is None
    assert BatchDecoder._tail(_decoder([20], urgent=lambda: []), rows) is None


def test_the_slots_left_empty_for_a_gathered_join_take_the_first_waiting_requests():
    """Rows with 9, 3 and 6 tokens left and one slot left empty (``_gather`` waits to admit its
    join with a later one): of four requests waiting, the first takes the empty slot, and the
    three after it take the slots the rows free, fewest tokens left first. Four waiting is then
    the last wave, which it is not with every slot live; five is not."""
    from types import SimpleNamespace

    from dflash_batch.engine.batch import BatchDecoder

    rows = [SimpleNamespace(budget=n) for n in (9, 3, 6)]
    assert BatchDecoder._tail(_decoder([40, 20, 10, 5], empty=1), rows) == [14, 23, 16]
    assert BatchDecoder._tail(_decoder([40, 20, 10, 5]), rows) is None
    assert BatchDecoder._tail(_decoder([40, 20, 10, 5, 1], empty=1), rows) is None
    assert BatchDecoder._tail(_decoder([40], empty=2), rows) == [9, 3, 6]  # all take empty slots


def test_a_last_wave_of_rows_that_stop_early_is_weighed_by_the_rate():
    """Rows mostly ending at EOS: the budgets the last wave would add are not what the slots
    have left, so it is not the tail; once the stream is closed it is, and once rows run to
    their budgets again so is the last wave."""
    from types import SimpleNamespace

    from dflash_batch.engine.batch import BatchDecoder
    from dflash_batch.engine.finish import Ends

    ends = Ends()
    assert ends.run_to_budgets()  # the prior: budgets
    for _ in range(3):
        ends.observe(False)
    assert not ends.run_to_budgets()

    rows = [SimpleNamespace(budget=n) for n in (9, 3)]
    assert BatchDecoder._tail(_decoder([20], ends=ends), rows) is None
    assert BatchDecoder._tail(_decoder([20], closed=True, ends=ends), rows) == [9, 3]
    for _ in range(10):
        ends.observe(True)
    assert BatchDecoder._tail(_decoder([20], ends=ends), rows) == [9, 23]


def test_the_engine_counts_how_its_rows_end(tiny_pair, chain_drafts):
    """Every finished row is counted once, at its budget or stopped before it, from job to
    job."""
    target, drafter = map(str, tiny_pair)
    engine = load_engine(target, drafter, cost_model=CostModel(t0=1.0, d0=0.1, window=0))
    ids = [engine.encode(f"Row {i}: count slowly") for i in range(5)]
    text = engine.generate(ids[3], max_tokens=60).text  # a stop string inside row 3's answer
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    engine.ends.decay = 1.0  # plain counts
    rows, at_budget = engine.ends.rows, engine.ends.at_budget
    done = engine.generate_batch(ids, max_tokens=[3, 40, 6, 60, 9], batch_size=2, stop=[stop])
    done += engine.generate_batch(ids[:2], max_tokens=4, batch_size=2)
    assert "stop" in [c.finish_reason for c in done]
    assert engine.ends.rows == rows + 7
    assert engine.ends.at_budget == at_budget + sum(c.finish_reason == "length" for c in done)
