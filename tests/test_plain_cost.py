"""A plain cycle costs the same with a drafter attached as without one (issue 36): counted, never
timed. The width policy does not weigh the widths again while a plain choice stands and nothing is
learnt (engine/widths.py), and a plain cycle runs no drafter pass and packs no context."""

from __future__ import annotations

import random

from dflash_batch.engine import decode, load_engine, widths
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.widths import CostModel, WidthPolicy

import pytest

CPU = dict(t0=1.0, t1=0.05, d0=0.3, d1=0.2, window=0)  # tests/test_widths.py's CPU costs


def _job(rows: int, tokens: int, p: float, seed: int = 0):
    """A job of ``rows`` rows of ``tokens`` tokens whose drafts are accepted with probability p:
    the widths chosen, and how often the widths were weighed (``_committed``)."""
    rng = random.Random(seed)
    weighed = []
    real = widths._committed

    def counted(*args):
        weighed.append(1)
        return real(*args)

    s = WidthPolicy(16, CostModel(**CPU))
    live = [(s.new_row(), tokens) for _ in range(rows)]
    chosen = []
    widths._committed = counted
    try:
        while live:
            T = s.width([e for e, _ in live], [n for _, n in live])
            chosen.append(T)
            left = []
            for estimate, n in live:
                L, a = min(T, n), 0
                while a < L - 1 and rng.random() < p:
                    a += 1
                s.accepted(estimate, a, L)
                if n > a + 1:
                    left.append((estimate, n - a - 1))
            live = left
    finally:
        widths._committed = real
    return chosen, len(weighed)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_a_plain_choice_stands_while_nothing_is_learnt(p, monkeypatch):
    """The same widths as weighing every cycle, from a fraction of the weighings."""
    replan = widths.REPLAN
    chosen, weighed = _job(8, 300, p)
    monkeypatch.setattr(widths, "REPLAN", 0)  # weigh every cycle
    every, weighed_every = _job(8, 300, p)
    assert chosen == every
    assert weighed_every >= len(chosen) - 1  # all but the last (one token left: plain, unweighed)
    plain = sum(T == 1 for T in chosen)
    drafting = len(chosen) - plain
    assert plain > 200
    # once per REPLAN plain cycles, after each cycle that verified a draft and as rows leave
    assert weighed <= plain // replan + 2 * drafting + 8 + 1, (weighed, plain, drafting)


def test_a_row_joining_is_weighed_at_once():
    """A new row's estimate (the job's) may make drafting pay where the failing rows' did not:
    the next cycle weighs the widths again."""
    s = WidthPolicy(16, CostModel(**CPU))
    for _ in range(20):
        s.job.update(15, 16)  # the job's drafts were all right so far
    bad = [s.new_row() for _ in range(4)]
    for e in bad:
        for _ in range(30):
            e.update(0, 16)  # these two rows' drafts always fail
    assert s.width(bad, [100] * 4) == 1
    assert s.width(bad, [100] * 4) == 1  # the choice stands
    good = s.new_row()
    assert s.width(bad + [good], [100] * 5) > 1


@pytest.fixture
def failing_engine(tiny_pair):
    """The tiny pair with costs where drafting never pays and probes are rare."""
    costs = CostModel(t0=1.0, t1=0.05, d0=50.0, window=0)
    return load_engine(*map(str, tiny_pair), cost_model=costs)


def test_a_plain_cycle_runs_no_drafter_pass_and_packs_nothing(failing_engine, monkeypatch):
    engine = failing_engine
    calls = {"drafter": 0, "pack": 0, "target": 0}
    drafter_type, target_type = type(engine.drafter), type(engine.target)
    for owner, name, counter in (
        (drafter_type, "draft_pass", "drafter"),
        (decode, "pack_context", "pack"),
        (target_type, "decode_pass", "target"),
    ):
        real = getattr(owner, name)

        def spy(*args, _real=real, _counter=counter, **kwargs):
            calls[_counter] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    per_cycle = []
    run = BatchDecoder.run

    def counted(self, width):
        before = dict(calls)
        steps = run(self, width)
        per_cycle.append((width, {k: calls[k] - before[k] for k in calls}))
        return steps

    monkeypatch.setattr(BatchDecoder, "run", counted)
    prompts = [engine.encode(f"Row {i}: tell a long story") for i in range(6)]
    engine.generate_batch(prompts, max_tokens=40, batch_size=6)
    plain = [c for w, c in per_cycle if w == 1]
    assert len(plain) > 30
    assert all(c == {"drafter": 0, "pack": 0, "target": 1} for c in plain), plain


@pytest.mark.parametrize("route", ["block", "sdpa"])
def test_plain_steps_attend_as_without_a_drafter_whatever_route_the_warm_up_chose(
    failing_engine, monkeypatch, route
):
    """The warm-up of an engine with a drafter picks the ragged route from drafting passes
    (engine/ops/attention.py); an engine without one never sets it. A plain step (one query row
    of a ragged batch) takes the block route on either, so it attends as without a drafter."""
    import dataclasses

    from dflash_batch.engine.ops import attention

    from tests.helpers import set_modes

    set_modes(
        monkeypatch, failing_engine, attention="reference"
    )  # the block route's pure-MLX form, on this CPU
    monkeypatch.setattr(
        failing_engine, "cost_model", dataclasses.replace(failing_engine.cost_model, route=route)
    )
    calls = []
    real = attention._block_attention

    def counted(impl, q, k, v, scale, causal, window, kv_len=None, sinks=None):
        calls.append((q.shape[2], kv_len is not None))
        return real(impl, q, k, v, scale, causal, window, kv_len, sinks)

    monkeypatch.setattr(attention, "_block_attention", counted)
    prompts = [
        failing_engine.encode(f"Row {i}: {'tell a story ' * (i + 1)}") for i in range(3)
    ]  # ragged lengths
    failing_engine.generate_batch(prompts, max_tokens=12, batch_size=3)
    assert (1, True) in calls  # one-row steps by block attention with per-row key lengths
