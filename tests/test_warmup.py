"""Warm-up (engine/warmup.py): passes timed at the job's batch size and context, the cost model
fitted from them, and the faster ragged attention route kept."""

from __future__ import annotations

from types import SimpleNamespace

from dflash_batch.engine import load_engine, warmup
from dflash_batch.engine.batch import EncodedRequest
from dflash_batch.engine.ops import attention, switch
from dflash_batch.engine.widths import buckets

import pytest


@pytest.fixture
def engine(tiny_pair):
    target_dir, draft_dir = tiny_pair
    return load_engine(str(target_dir), str(draft_dir))


def fake_passes(monkeypatch, target, draft=lambda B: 0.5):
    """Time no model: a verify pass of T rows at batch size B takes ``target(B, T)`` seconds, a
    drafter pass ``draft(B)``."""

    class Timed:
        def __init__(self, engine, B, n):
            self.B = B

        def target(self, T):
            return target(self.B, T)

        def prime(self):
            pass

        def draft(self):
            return draft(self.B)

    monkeypatch.setattr(warmup, "_Passes", Timed)


def test_passes_are_timed_at_the_jobs_context(engine, monkeypatch):
    seen = []
    real = warmup._Passes

    class Spy(real):
        def __init__(self, engine, B, n):
            super().__init__(engine, B, n)
            seen.append((B, n, list(self.lengths.host), self.cache[0].keys is None))

        # costs by the rows a pass verifies, not timed: the order below holds on a busy CPU too
        def target(self, T):
            return 0.01 * (1 + self.B * T)

        def draft(self):
            return 0.005 * self.B

    monkeypatch.setattr(warmup, "_Passes", Spy)
    cost = engine.warm_up(4, context=300)
    assert cost.context == 300
    assert {B for B, *_ in seen} == {1, 4}
    for B, n, rows, _ in seen:
        assert rows == [
            300 - b % 4 for b in range(B)
        ]  # about the context, not equal (a ragged batch)
    assert cost.passes(4, 16) > cost.passes(4, 1) > 0


def test_a_job_of_another_context_is_warmed_up_again(engine, monkeypatch):
    contexts = []
    measure = warmup.measure_costs

    def counted(engine, batch_size, context=None):
        contexts.append(context)
        return measure(engine, batch_size, context)

    monkeypatch.setattr(warmup, "measure_costs", counted)
    short = [engine.encode("Count: one two three")] * 2
    engine.generate_batch(short, max_tokens=8, batch_size=2)
    engine.generate_batch(
        short, max_tokens=10, batch_size=2
    )  # the same power of two: no new warm-up
    assert len(contexts) == 1
    long = [engine.encode("Tell me everything about the number seven. " * 30)] * 2
    engine.generate_batch(long, max_tokens=8, batch_size=2)
    assert len(contexts) == 2 and contexts[1] > 4 * contexts[0]


def test_the_faster_ragged_route_is_kept(engine, monkeypatch):
    """On a GPU the warm-up times both routes at the job's batch size; here the timings are faked:
    whichever route is faster must be the one set for the job."""
    for fast in attention.RAGGED_ROUTES:
        fake_passes(
            monkeypatch, lambda B, T, fast=fast: 1.0 if attention.ragged_route() == fast else 2.0
        )
        monkeypatch.setattr(warmup, "_routes_differ", lambda: True)
        with switch.modes(ragged="sdpa" if fast == "block" else "block"):
            cost = warmup.measure_costs(engine, 8, 256)
        assert cost.route == fast
        assert engine.settings.routes(cost).ragged == fast  # the job's steps run under it


@pytest.mark.parametrize("fast", ["kernel", "stock"])
def test_the_faster_few_row_matmul_is_kept(engine, monkeypatch, fast):
    """Where the few-row matmul is a kernel (CUDA), the warm-up times the job's most frequent pass
    that it would take both ways; here the timings are faked: whichever mode is faster must be the
    one the job's steps run under, at batch 1 (the drafting cycle, drafter included) and at a batch
    of a few rows (the plain cycle). A batch too wide for the kernel times nothing twice."""

    def slow(seconds):
        return seconds if switch.current().matmul == fast else 2 * seconds

    monkeypatch.setattr(warmup, "_matmul_differs", lambda: True)
    for B in (1, 8):
        timings = []
        fake_passes(
            monkeypatch,
            lambda B, T: timings.append((B, T, switch.current().matmul)) or slow(0.01 * T),
            draft=lambda B: slow(0.5) if B == 1 else 0.5,
        )
        with switch.modes(matmul="kernel"):
            cost = warmup.measure_costs(engine, B, 256)
        assert cost.matmul == fast
        assert engine.settings.routes(cost).matmul == fast
        # the widths are timed under the mode kept
        assert {mode for _, _, mode in timings[2:]} == {fast}
    fake_passes(monkeypatch, lambda B, T: 0.01 * T)
    with switch.modes(matmul="kernel"):
        assert warmup.measure_costs(engine, 32, 256).matmul is None  # nothing chosen


@pytest.mark.parametrize("fast", ["kernel", "stock"])
def test_an_engine_without_a_drafter_runs_the_faster_few_row_matmul_too(
    qwen3_target, monkeypatch, fast
):
    """Plain decoding at a batch of a few rows is where the kernel's cost shows most: an engine
    without a drafter (no cost model) has its plain cycle timed both ways once a batch size and
    context, and its steps run under the faster."""
    plain = load_engine(str(qwen3_target), matmul="kernel")
    timings = []
    fake_passes(
        monkeypatch,
        lambda B, T: timings.append((B, T)) or (0.01 if switch.current().matmul == fast else 0.02),
    )
    monkeypatch.setattr(warmup, "_matmul_differs", lambda: True)
    requests = [EncodedRequest(plain.encode("Count: one two three"), max_tokens=8)] * 8
    policy = plain._width_policy(8, requests)
    assert plain._routes(policy).matmul == fast
    assert timings == [(8, 1), (8, 1)]
    plain._width_policy(8, requests)
    assert len(timings) == 2  # once a process
    again = load_engine(str(qwen3_target), matmul="kernel")  # a later process
    assert again._routes(again._width_policy(8, requests)).matmul == fast
    assert len(timings) == 2  # and once a machine: the choice is kept in the model cache
    assert plain._routes(plain._width_policy(1, requests[:1])).matmul == "kernel"  # one row: none


def test_every_width_is_timed_where_cost_is_not_linear_in_the_width(engine, monkeypatch):
    """Three widths first; where the middle one is off the line through the others, every width
    the width policy chooses among, so it reads real costs rather than the line. (A GPU's check:
    the CPU's costs are a line in the rows verified, timed at two widths, below.)"""
    monkeypatch.setattr(warmup, "_quick", lambda: False)
    for costs, timed in (({1: 1.0, 8: 1.1, 16: 3.0}, 8), ({1: 1.0, 8: 2.0, 16: 3.0}, 3)):
        fake_passes(monkeypatch, lambda B, T, costs=costs: costs.get(T, 1.5) * B)
        cost = warmup.measure_costs(engine, 4, 128)
        assert len(cost.timed) == timed
        assert cost.target(4, 8) == pytest.approx(costs[8] * 4)


def test_a_gpu_job_of_one_row_times_every_width_where_launches_dominate(engine, monkeypatch):
    """At batch 1 on a GPU a small target's pass is mostly launches: T > 1 costs about the same at
    every width (the default pair on an H200: 3.7 ms at T = 1, 7.2 at 16). The warm-up times the
    middle width too and, off the line, every width: the line through T = 1 and 16 would put
    T = 4 at 4.4 ms and keep the width policy at narrow widths that cost as much as the block."""
    monkeypatch.setattr(warmup, "_quick", lambda: False)
    costs = {
        1: 0.0037,
        2: 0.0068,
        3: 0.0069,
        4: 0.0069,
        6: 0.0070,
        8: 0.0070,
        12: 0.0071,
        16: 0.0072,
    }
    asked = []

    def target(B, T):
        asked.append((B, T))
        return costs[T] * B

    fake_passes(monkeypatch, target)
    cost = warmup.measure_costs(engine, 1, 128)
    assert sorted(T for _, T in asked) == sorted(costs)
    assert cost.target(1, 4) == pytest.approx(costs[4])
    asked.clear()
    costs = {T: 0.0037 + 0.0002 * (T - 1) for T in costs}  # a line: the three widths suffice
    cost = warmup.measure_costs(engine, 1, 128)
    assert sorted(T for _, T in asked) == [1, 8, 16]
    assert cost.target(1, 4) == pytest.approx(costs[4])


def test_timed_passes_roll_back_as_a_cycle_does(engine, monkeypatch):
    """A hybrid target's cycle replays its recurrent layers to each row's kept length; the warm-up
    must time that too (keeping every step skips the replay and underrates drafting's cost)."""
    keeps = []
    rollback = type(engine.target).rollback

    def spy(target, cache, keep):
        keeps.append(list(keep))
        return rollback(target, cache, keep)

    monkeypatch.setattr(type(engine.target), "rollback", spy)
    warmup.measure_costs(engine, 4, 128)
    assert any(len(set(k)) > 1 and min(k) < max(k) for k in keeps)  # ragged keeps, some cut short


def test_the_cpu_warm_up_times_each_pass_twice_at_two_widths(engine, monkeypatch):
    """On the CPU a pass compiles nothing and each pass of even a small pair costs tens of ms: at
    batch 8, 4 timed verify passes (T = 1 and 4 at batch 1 and 8), one untimed first pass, and 2
    drafter passes, each timed pass run twice (its two runs agree here: no third), where the
    GPU's way runs about 30 (4 s of the README's 20 s job). (A pass under CHEAP_PASS, a tiny
    model's, is timed as on a GPU: its first run's one-off costs would swamp it.)"""
    if warmup.mx.default_device() != warmup.mx.cpu:
        pytest.skip("the CPU's warm-up")
    verifies, drafts = [], []
    verify = type(engine.target).verify
    draft_block = warmup.decode.draft_block
    # a clock the passes advance by the rows they verify: the costs below do not hang on the VM's load
    clock = [0.0]
    monkeypatch.setattr(warmup, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def spy_verify(target, tokens, cache, *args, **kwargs):
        verifies.append(tokens.shape)
        clock[0] += 0.01 * (1 + tokens.shape[0] * tokens.shape[1])
        return verify(target, tokens, cache, *args, **kwargs)

    draft_candidates = warmup.decode.draft_candidates

    def spy_draft(*args, **kwargs):
        drafts.append(args[2].shape[0])
        return draft_block(*args, **kwargs)

    def spy_candidates(*args, **kwargs):  # a tree cycle's drafting (the CPU's default)
        drafts.append(args[2].shape[0])
        return draft_candidates(*args, **kwargs)

    monkeypatch.setattr(type(engine.target), "verify", spy_verify)
    monkeypatch.setattr(warmup.decode, "draft_block", spy_draft)
    monkeypatch.setattr(warmup.decode, "draft_candidates", spy_candidates)
    monkeypatch.setattr(
        warmup, "CHEAP_PASS", 0.0
    )  # the tiny pair's passes, as slow as the default pair's
    cost = warmup.measure_costs(engine, 8, 128)
    assert sorted(verifies) == sorted([(8, 1)] + 2 * [(8, 1), (8, 4), (1, 1), (1, 4)])
    assert sorted(drafts) == [1, 1, 8, 8]
    assert (
        sorted(cost.timed) == [1, 4]
        and cost.passes(8, 16) > cost.passes(8, 4) > cost.passes(8, 1) > 0
    )


def test_two_widths_give_every_width_where_costs_are_a_line(engine, monkeypatch):
    """target(B, T) = 1 + 0.1 B T + 0.05 B, draft(B) = 0.3 + 0.2 B: the CPU's timings at T = 1 and
    4 give the same costs at every width and batch size as the line itself."""
    fake_passes(monkeypatch, lambda B, T: 1 + 0.1 * B * T + 0.05 * B, lambda B: 0.3 + 0.2 * B)
    cost = warmup.measure_costs(engine, 8, 128)
    for B in (1, 3, 8):
        for T in (1, 2, 6, 16):
            assert cost.passes(B, T) == pytest.approx(
                1 + 0.1 * B * T + 0.05 * B + (0.3 + 0.2 * B if T > 1 else 0)
            )


def test_a_cpu_job_of_one_row_reads_its_costs_from_three_timed_widths(engine, monkeypatch):
    """At batch 1 a CPU pass's cost is not a line in T (the default pair on the 2-core VM: 52, 71,
    100 ms at T = 1, 4, 16): the warm-up times the block too, and the widths between are read
    from the three, not from the line through T = 1 and 4 (152 ms at 16), which would keep the
    width policy from verifying wide blocks that pay."""
    costs = {1: 0.052, 4: 0.071, 16: 0.100}
    asked = []

    def target(B, T):
        asked.append((B, T))
        return costs[T] * B

    fake_passes(monkeypatch, target, lambda B: 0.03)
    monkeypatch.setattr(warmup, "_quick", lambda: True)
    cost = warmup.measure_costs(engine, 1, 128)
    assert sorted(asked) == [(1, 1), (1, 4), (1, 16)]
    for T, s in costs.items():
        assert cost.target(1, T) == pytest.approx(s)
    assert cost.target(1, 10) == pytest.approx(0.071 + (0.100 - 0.071) * 6 / 12)
    asked.clear()
    cost = warmup.measure_costs(engine, 8, 128)  # batch 8: a line, two widths at each batch size
    assert sorted(asked) == [(1, 1), (1, 4), (8, 1), (8, 4)]


def test_a_load_spike_in_a_cpu_timing_does_not_move_the_kept_figure(engine, monkeypatch):
    """A pass the CPU's warm-up times, slowed in one of its runs by other work on the machine, or
    in its first two by different amounts (a third run where two differ): the kept figure is the
    pass's own whichever runs the spike hit, the first timed pass (the width-1 pass at the job's
    batch size, the one the width policy and the saved-time estimate price plain decoding from)
    included. One run a pass kept the spike, two without a third the last case's. A clock the
    passes advance by the rows they verify: nothing here hangs on the VM's load."""
    if warmup.mx.default_device() != warmup.mx.cpu:
        pytest.skip("the CPU's warm-up")
    clock, calls = [0.0], [0]
    monkeypatch.setattr(warmup, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(warmup, "CHEAP_PASS", 0.0)
    verify = type(engine.target).verify

    def slowed(spikes):
        def spy(target, tokens, cache, *args, **kwargs):
            calls[0] += 1
            B, T = tokens.shape
            clock[0] += 0.01 * (1 + B * T) * spikes.get(calls[0], 1.0)
            return verify(target, tokens, cache, *args, **kwargs)

        return spy

    monkeypatch.setattr(type(engine.target), "verify", slowed({}))
    calm = warmup.measure_costs(engine, 8, 128)
    assert calm.timed == pytest.approx({1: 0.09, 4: 0.33})
    # call 1 is the untimed first pass; 2 and 3 time width 1 at batch 8, and 4 where they differ
    for spikes in ({2: 5.0}, {3: 5.0}, {2: 5.0, 4: 5.0}, {2: 5.0, 3: 2.0}):
        calls[0] = 0
        monkeypatch.setattr(type(engine.target), "verify", slowed(spikes))
        cost = warmup.measure_costs(engine, 8, 128)
        assert cost.timed == pytest.approx(calm.timed), spikes
        assert cost.cycle(8, 1) == pytest.approx(calm.cycle(8, 1))


@pytest.mark.parametrize("block", [10, 16])
@pytest.mark.parametrize("line", [True, False])
def test_a_gpu_warm_up_times_bucket_widths_only(engine, monkeypatch, block, line):
    """A pass runs at a bucket width only (engine/widths.py: ``buckets``), so the warm-up times
    (and so compiles) those: its middle width too, for a block whose half is not one."""
    monkeypatch.setattr(warmup, "_quick", lambda: False)
    monkeypatch.setattr(engine, "block_size", block)
    asked = set()

    def target(B, T):
        asked.add(T)
        return (1.0 + 0.1 * T if line else 1.0 + (T > 1)) * B

    fake_passes(monkeypatch, target)
    warmup.measure_costs(engine, 4, 128)
    assert asked <= set(buckets(block)) and block in asked
    assert asked == set(buckets(block)) or (line and len(asked) == 3)


@pytest.mark.parametrize(
    "mode,batch_size,sizes",
    [("compiled", 16, {9, 16}), ("compiled", 8, {1, 8}), ("eager", 16, {1, 16})],
)
def test_a_gpu_job_wider_than_compiled_passes_times_no_compiled_batch(
    engine, monkeypatch, mode, batch_size, sizes
):
    """On a GPU whose passes compile at compiled.MAX_ROWS rows or fewer, a wider job's passes are
    timed at the narrowest eager batch size, not at batch 1: tracing a one-row pass was most of a
    fresh machine's warm-up, for a pass shape such a job does not run."""
    from dflash_batch.engine.ops import compiled

    monkeypatch.setattr(warmup, "_quick", lambda: False)
    monkeypatch.setattr(compiled, "mode", lambda: mode)
    asked = set()

    def target(B, T):
        asked.add(B)
        return 0.001 * (1 + B * T)

    fake_passes(monkeypatch, target)
    cost = warmup.measure_costs(engine, batch_size, 128)
    assert asked == sizes
    assert cost.target(batch_size, 4) == pytest.approx(0.001 * (1 + batch_size * 4))
    assert cost.target(1, 4) == pytest.approx(0.001 * 5, rel=0.05)  # the line reaches batch 1


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_the_drafter_is_timed_as_the_jobs_drafting_cycles_draft(tiny_pair, monkeypatch, mode):
    """A tree cycle drafts each position's candidates and grows the trees on the host, which costs
    more than a chain's drafting: the warm-up times the drafting the engine's cycles do, or the
    cost model prices tree cycles below what they cost."""
    monkeypatch.setenv("DFLASH_BATCH_DRAFTS", mode)
    engine = load_engine(*map(str, tiny_pair))
    called = []
    for name in ("draft_block", "draft_candidates"):
        real = getattr(warmup.decode, name)
        monkeypatch.setattr(
            warmup.decode,
            name,
            lambda *a, real=real, name=name, **k: called.append(name) or real(*a, **k),
        )
    grown = []
    best_first = warmup.tree.best_first
    monkeypatch.setattr(
        warmup.tree, "best_first", lambda *a: grown.append(len(a[0])) or best_first(*a)
    )
    warmup.measure_costs(engine, 4, 64)
    assert called and set(called) == {"draft_candidates" if mode == "tree" else "draft_block"}
    # the trees of every row of each batch size timed (the job's, and batch 1)
    assert set(grown) == ({4, 1} if mode == "tree" else set())


def test_the_drafter_is_timed_on_context_packed_as_a_cycle_packs_it(engine, monkeypatch):
    """A cycle's drafter reads its new context packed from the pieces earlier cycles left, and
    pieces of unequal rows are gathered (``decode.pack_context``): an op a job's first drafting
    cycle would otherwise be the first to run (a process's first gather took seconds on a GPU).
    Every timed drafter pass packs its context that way, gathering included."""
    packs = []
    real = warmup.decode.pack_context

    def pack_context(pieces):
        packs.append((warmup.decode.gathers(pieces), [tuple(rows.shape) for rows, _ in pieces]))
        return real(pieces)

    monkeypatch.setattr(warmup.decode, "pack_context", pack_context)
    drafted = []  # the context each timed drafter pass (chain or tree) was given
    for name in ("draft_block", "draft_candidates"):
        draft = getattr(warmup.decode, name)
        monkeypatch.setattr(
            warmup.decode,
            name,
            lambda *a, draft=draft, **k: drafted.append(a[3].shape) or draft(*a, **k),
        )
    warmup.measure_costs(engine, 4, 64)
    assert drafted and len(packs) == len(drafted)
    assert all(gathers for gathers, _ in packs)
    # each row's context is the rows one timed verify pass tapped, as before
    taps = engine.drafter.fc.weight.shape[-1]
    for (_, shapes), context in zip(packs, drafted):
        assert context[1] == shapes[0][1] and context[2] == taps
