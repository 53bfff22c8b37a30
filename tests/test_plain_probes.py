"""Plain probes (engine/widths.py, module doc): while the width policy drafts, a plain cycle now
and then keeps the width-1 cost learnt from real cycles. No timing: a job's cycles are charged
the seconds of a scripted "real" machine and fed to the cost model's ``observe`` as the engine
feeds its timed cycles; each row accepts each draft with probability p until its first
rejection."""

import random

from dflash_batch.engine import batch, load_engine
from dflash_batch.engine.output import RowOutput
from dflash_batch.engine.widths import CostModel, PlainProbes, WidthPolicy, pooled_acceptance

import pytest

from tests.helpers import StepClock, greedy_reference
from tests.scripting import ScriptedDrafts

BLOCK = 16
ROWS = 8


def cpu_target(B, T):
    """A CPU's verify pass: a line in the rows verified (the default pair's shape, in seconds)."""
    return 0.02 + 0.009 * B * T


def cpu_draft(B):
    return 0.02 + 0.004 * B


def gpu_target(B, T):
    """A GPU's: extra rows nearly free."""
    return 1.0 + 0.002 * B * T


def gpu_draft(B):
    return 0.15 + 0.002 * B


def warmed_up(target, draft, spike: float = 1.0) -> CostModel:
    """The cost model the CPU's warm-up fits (engine/warmup.py: widths 1 and 4 at batch 1 and at
    the job's batch size), its width-1 pass at the job's batch size timed ``spike`` times dear."""
    timed = {(B, T): target(B, T) for B in (1, ROWS) for T in (1, 4)}
    timed[(ROWS, 1)] *= spike
    cost = CostModel.fit(timed, {B: draft(B) for B in (1, ROWS)})
    cost.rows, cost.timed = ROWS, {T: s for (B, T), s in timed.items() if B == ROWS}
    return cost


def run(cost: CostModel, target, draft, p: float, cycles: int, seed: int = 0):
    """``cycles`` cycles over ROWS rows that never run out of budget, each charged the real
    machine's seconds and observed: (the widths chosen, the seconds spent)."""
    rng = random.Random(seed)
    policy = WidthPolicy(BLOCK, cost)
    rows = [policy.new_row() for _ in range(ROWS)]
    widths, spent = [], 0.0
    for _ in range(cycles):
        T = policy.width(rows, [10**6] * ROWS)
        seconds = target(ROWS, T) + (draft(ROWS) if T > 1 else 0.0)
        cost.observe(ROWS, T, seconds)
        widths.append(T)
        spent += seconds
        for row in rows:
            a = 0
            while a < T - 1 and rng.random() < p:
                a += 1
            policy.accepted(row, a, T)
    return widths, spent


def test_a_width_one_pass_timed_in_a_spike_is_corrected_by_plain_probes():
    """Drafts accepted 30% of the time: on this machine plain decoding commits 87 tokens a second
    and the best drafting width 48 (T = 2). A warm-up whose width-1 pass at the job's batch size
    was timed in a load spike (5x) prices plain decoding at 17 a second: the width policy drafts,
    and without plain cycles nothing corrects that. The plain probes do: within 80 cycles it
    decodes plainly, and stays there but for its drafting probes (here from cycle 20)."""
    cost = warmed_up(cpu_target, cpu_draft, spike=5.0)
    widths, _ = run(cost, cpu_target, cpu_draft, p=0.3, cycles=400)
    assert widths[0] > 1  # the spike's doing: plain decoding priced too dear
    plain_from = [i for i in range(len(widths)) if sum(T == 1 for T in widths[i : i + 40]) >= 36]
    settled = plain_from[0] if plain_from else len(widths)  # 36 of the next 40 cycles plain
    assert settled <= 80, settled
    tail = widths[settled:]
    assert sum(T == 1 for T in tail) >= 0.9 * len(tail)


def test_plain_probes_cost_at_most_their_share_where_drafting_pays():
    """Every draft accepted on a GPU's costs: the width policy drafts the whole block every cycle,
    and a plain probe commits 8 tokens where a drafting cycle commits 128. Over 300 drafting
    cycles the probes run 5 times (the first 3 at the 5% share, then at a share halved per probe
    that left it drafting: a fixed share would probe 15 times), and lose 1.1% of the time the job
    would take drafting throughout (a fixed share: 3.4%), never more than the 5% share."""
    cost = warmed_up(gpu_target, gpu_draft)
    widths, spent = run(cost, gpu_target, gpu_draft, p=1.0, cycles=300)
    probes = [i for i, T in enumerate(widths) if T == 1]
    assert all(T == BLOCK for T in widths[3:] if T != 1)  # the first learn p from the neutral 0.5
    assert 1 <= len(probes) <= 6, probes
    # a probe's loss: its seconds, less what its tokens take in the block's cycles
    block = gpu_target(ROWS, BLOCK) + gpu_draft(ROWS)
    lost = len(probes) * (gpu_target(ROWS, 1) - block / BLOCK)
    share = lost / (spent - lost)  # of the same job drafting throughout
    assert 0 < share <= 0.02, share
    assert share <= WidthPolicy(BLOCK, cost).probe_share


def jobs(cost: CostModel, target, draft, p: float, count: int, tokens: int, plain=None):
    """``count`` jobs of ROWS rows one after another on one engine, each row ending at an EOS
    after about ``tokens`` tokens, well before its budget (so no cycle is plain for want of
    budget): each job a new width policy given the engine's pooled acceptance and, if ``plain``,
    its plain probes' spending (``Engine._width_policy``), else each job's own. The widths each
    job chose."""
    rng = random.Random(0)
    pooled = pooled_acceptance(BLOCK)
    out = []
    for _ in range(count):
        own = plain if plain is not None else PlainProbes()
        policy = WidthPolicy(BLOCK, cost, job=pooled, plain=own)
        live, widths = [(policy.new_row(), tokens) for _ in range(ROWS)], []
        while live:
            T = policy.width([e for e, _ in live], [10**6] * len(live))
            cost.observe(len(live), T, target(len(live), T) + (draft(len(live)) if T > 1 else 0.0))
            widths.append(T)
            left = []
            for row, n in live:
                a = 0
                while a < T - 1 and rng.random() < p:
                    a += 1
                policy.accepted(row, a, T)
                if n > a + 1:
                    left.append((row, n - a - 1))
            live = left
        out.append(widths)
    return out


def test_short_jobs_still_probe_and_within_their_share():
    """Jobs of 3 cycles, every draft right, on a GPU's costs: no job drafts long enough for a
    probe of its own, so the width-1 cost would never be measured again. The engine's
    ``PlainProbes`` counts the drafting of every job: over 100 jobs the probes run as in one
    long job (5 in 300 cycles), within their share."""
    cost = warmed_up(gpu_target, gpu_draft)
    shared = sum(jobs(cost, gpu_target, gpu_draft, 1.0, 100, 48, plain=PlainProbes()), [])
    probes = shared.count(1)
    assert 1 <= probes <= 6, probes
    block = gpu_target(ROWS, BLOCK) + gpu_draft(ROWS)
    lost = probes * (gpu_target(ROWS, 1) - block / BLOCK)
    spent = sum(gpu_target(ROWS, T) + (gpu_draft(ROWS) if T > 1 else 0.0) for T in shared)
    assert lost / (spent - lost) <= 0.02
    alone = sum(jobs(warmed_up(gpu_target, gpu_draft), gpu_target, gpu_draft, 1.0, 100, 48), [])
    assert alone.count(1) == 0


def test_a_cost_model_that_learns_nothing_is_not_probed():
    """``window`` 0: cycles teach the cost model nothing, so a plain probe would only lose."""
    cost = warmed_up(gpu_target, gpu_draft)
    cost.window = 0
    widths, _ = run(cost, gpu_target, gpu_draft, p=1.0, cycles=300)
    assert 1 not in widths and widths[3:] == [BLOCK] * 297


def test_the_per_row_plain_estimate_follows_the_width_one_cost_as_relearnt(tiny_pair, monkeypatch):
    """The engine end to end (runner/saved.py's ``plain_seconds_est``): a warm-up priced a plain
    cycle at 5 s where every cycle really takes 1 s (a scripted clock), and each draft is right
    30% of the time: at 1 s a cycle of any width, the width policy drafts but for its plain probes.
    These re-learn the width-1 cost, and the row's later tokens are priced at it: the figure each
    cycle hands the row is the cost model's at that cycle, not a copy taken at the start (which
    would price every token at 5 s), nor the warm-up's (no plain probes)."""
    monkeypatch.setattr(batch, "time", StepClock(1.0))  # each cycle takes 1 s
    target, draft = map(str, tiny_pair)
    engine = load_engine(target, draft, cost_model=CostModel(t0=5.0, window=16), drafts="chain")
    prompt = [(7 * i) % 90 + 4 for i in range(8)]
    reference = greedy_reference(target, prompt, 160, engine.tokenizer.eos_token_ids)
    ScriptedDrafts(monkeypatch)(prompt + reference + [0] * 16, p_wrong=0.7)
    figures = []
    timed = RowOutput.timed

    def spy(self, share, plain_token):
        figures.append(plain_token)
        timed(self, share, plain_token)

    monkeypatch.setattr(RowOutput, "timed", spy)
    (done,) = engine.generate_batch([prompt], max_tokens=160, batch_size=1)
    n = done.stats.generated_tokens
    assert n == len(reference) and n > 100, n
    assert figures[0] == pytest.approx(5.0) and figures[-1] == pytest.approx(1.0)
    assert engine.plain_probes.failed > 0  # the engine's share was spent, kept for its next job
    estimate = done.stats.plain_seconds_est
    assert n - 1 <= estimate <= 0.8 * 5.0 * (n - 1), estimate  # a copy from the start: 5 (n - 1)
