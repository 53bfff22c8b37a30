"""Warm-up: compile the passes a job runs and time them, for the width policy's cost model.

Passes are timed where the job will run them: at batch 1 (on a GPU, for a job wider than the
rows whose passes compile, at the narrowest eager batch instead: ``_batch_sizes``) and at the
job's batch size, with the rows holding about the job's typical context (prompt and half its
budget), of slightly different lengths as in a job. The cache is allocated for that context
without a prefill: what the keys hold does not change what a pass costs. Timed on a GPU (each
once to compile, then the fastest of three: other work on the machine only ever adds time):

    target(B, T)   verify passes of 1, block / 2 (a bucket: up) and block rows at the job's batch size (of 1
                   and block at batch 1 for a wider job); where the middle one is off the line
                   through the others by more than 10% (a GPU's attention works in tiles of
                   query rows; at batch 1 its launches cost the same at every T > 1), every bucket width a pass
                   runs at (engine/widths.py: ``buckets``: 1, 2, 3, 4, 6, 8, 12, 16 for a block of 16);
                   on a quantized target every width always: Metal runs a quantized matmul's vector
                   path (qmv) up to a row count that depends on the chip and the layer, and its
                   general one (qmm) above, a step in T that three widths on a line can hide
    draft(B)       one drafter pass over a block of new context rows (those the widest timed
                   verify pass tapped, packed from pieces as a cycle packs them: ``decode.
                   pack_context``), compiled where the job's are (engine/ops/compiled.py);
                   where the job's cycles draft trees (engine/tree.py), with each position's
                   candidates and the trees grown on the host, as theirs do

On the CPU a pass compiles nothing (its first run costs what later ones do, but for a process's
first pass at a wide batch, run untimed) and costs a line in the rows it verifies, while each
pass of even a small pair costs tens of milliseconds: there the warm-up runs each pass it times
twice and keeps the faster, three times where the two differ by more than AGREE (a pass under
CHEAP_PASS, a tiny model's, as on a GPU), verify passes of 1 and PROBE_WIDTH rows only (the line
through them gives the other widths; a job of one row times the block too, and reads the widths
between from the three), and the drafter over that many new context rows. On the default pair
at batch 8 that is 6 passes timed in 12 runs (18 at most) and 1 untimed, where the GPU's way
runs about 30 (what each costs: docs/results/engine-floors.md). One run a pass let a load spike
in the width-1 pass price plain decoding too dear for the job and, through the persisted table,
for every later process.

On a GPU backend whose block attention is a kernel, the ragged route (engine/ops/attention.py) is
chosen here too: the target and drafter passes at the job's batch size are timed with block
attention and with stock SDPA over the bucketed cache, and the faster is kept for the job. The
first job of a process no longer pays for compilation inside its first items, and the width policy
gets costs measured on this machine, for this model, in this dtype, at this context.

Where the few-row matmul is a kernel (engine/ops/matmul.py, CUDA), whether it or MLX's matmul
serves the job is chosen here as well: the job's most frequent pass whose products it would take
(a plain cycle at a batch of a few rows; at batch 1 a drafting cycle, target and drafter) is
timed both ways and the faster kept for the job: the kernel was made for a small model's layers
at batch 1, and on a larger model's it can cost twice what MLX's matmul does.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from . import decode, tree
from .models import hybrid
from .ops import attention, compiled, device, matmul, switch
from .ops.batch_cache import Lengths, round_up
from .widths import PROBE_WIDTH, CostModel, bucket, buckets

SHORT_CONTEXT = 64  # tokens per row when the job's context is not known
# seconds: a CPU pass this quick is timed as on a GPU (repeating it costs nothing)
CHEAP_PASS = 0.02
AGREE = 0.25  # two CPU timings of a pass this close (relative): neither was slowed much, no third


def context_bucket(context: int) -> int:
    """The power of two at or above ``context`` (at least SHORT_CONTEXT): costs measured at one
    context serve every job whose typical context falls in the same bucket."""
    n = SHORT_CONTEXT
    while n < context:
        n *= 2
    return n


def measure_costs(engine, batch_size: int, context: Optional[int] = None) -> CostModel:
    """Time the passes (module doc) and fit the cost model, with the ragged route and the few-row
    matmul chosen (a GPU's)."""
    n = max(int(context or SHORT_CONTEXT), 4)
    block = max(engine.block_size, 2)
    targets: Dict[Tuple[int, int], float] = {}
    drafts: Dict[int, float] = {}
    route = switch.current().ragged
    if batch_size > 1 and _routes_differ():
        # route -> (target(batch_size, block), draft(batch_size))
        timed = _timed_under(
            engine,
            batch_size,
            n,
            {route: {"ragged": route} for route in attention.RAGGED_ROUTES},
            lambda passes: (
                passes.target(block),
                passes.draft() if engine.drafter is not None else 0.0,
            ),
        )
        route = min(timed, key=lambda r: sum(timed[r]))
        targets[(batch_size, block)] = timed[route][0]  # timed already: not again below
        if engine.drafter is not None:
            drafts[batch_size] = timed[route][1]
    # a drafting job's most frequent few-row pass: at batch 1 a drafting cycle, else a plain one
    few_rows = choose_matmul(engine, batch_size, n, block if batch_size == 1 else 1, route)
    with switch.modes(ragged=route, matmul=few_rows or matmul.mode()):
        _time_widths(engine, batch_size, n, block, targets, drafts)
    mx.clear_cache()  # the timing batches' buffers: the job allocates its own (see batch.py: steps)
    cost = CostModel.fit(targets, drafts)
    cost.context = n
    cost.route, cost.matmul = route, few_rows
    cost.rows, cost.timed = batch_size, {T: s for (B, T), s in targets.items() if B == batch_size}
    return cost


def choose_matmul(
    engine, batch_size: int, context: int, width: int, route: Optional[str] = None
) -> Optional[str]:
    """The few-row matmul mode a job should run under (module doc), from its most frequent pass
    whose products the kernel would take: ``width`` rows at ``batch_size``; None where there is
    no choice (no kernel here, or that pass is not a few rows)."""
    if not matmul_choice(batch_size, width):
        return None
    return _faster_matmul(engine, batch_size, context, width, route or switch.current().ragged)


def matmul_choice(batch_size: int, width: int) -> bool:
    """Whether the few-row matmul is to be chosen for passes of ``width`` rows at ``batch_size``:
    a kernel runs here, and those passes are a few rows."""
    return matmul.MIN_ROWS <= batch_size * width <= matmul.MAX_ROWS and _matmul_differs()


def _faster_matmul(engine, batch_size: int, n: int, T: int, route: str) -> str:
    """The few-row matmul mode under which that pass (and at batch 1 the drafter's, a block of
    rows too) is faster: which one is depends on the model's layers and the machine
    (docs/results/never-loses.md, session 22)."""
    drafts = batch_size == 1 and engine.drafter is not None
    timed = _timed_under(
        engine,
        batch_size,
        n,
        {mode: {"ragged": route, "matmul": mode} for mode in ("kernel", "stock")},
        lambda passes: passes.target(T) + (passes.draft() if drafts else 0.0),
    )
    return min(timed, key=timed.get)


def _timed_under(engine, B: int, n: int, choices: Dict[str, dict], time: Callable) -> dict:
    """``time(passes)`` for a batch of B rows of about n tokens built afresh under each choice's
    routing (``switch.modes``), by choice: what the warm-up's choices between routings compare."""
    timed = {}
    for name, modes in choices.items():
        with switch.modes(**modes):
            passes = _Passes(engine, B, n)
            timed[name] = time(passes)
        del passes
    return timed


def _time_widths(
    engine,
    batch_size: int,
    n: int,
    block: int,
    targets: Dict[Tuple[int, int], float],
    drafts: Dict[int, float],
) -> None:
    """Time target passes at the widths chosen among, and drafter passes, at the two batch sizes
    of ``_batch_sizes``."""
    quick = _quick()
    for i, B in enumerate(sorted(_batch_sizes(batch_size, quick), reverse=quick)):
        passes = _Passes(engine, B, n)
        if quick and i == 0:
            passes.prime()
        widths = _first_widths(B, block, quick, alone=batch_size == 1)
        for T in widths:
            if (B, T) not in targets:
                targets[(B, T)] = passes.target(T)
        # a quantized matmul switches from its vector path to its general one at some row count:
        # a step in T that three widths on a line can hide
        stepped = engine.target.quantized
        middle = bucket(block // 2, block)
        if (
            not quick
            and middle in widths
            and (stepped or not _straight([(T, targets[(B, T)]) for T in (1, middle, block)]))
        ):
            # not linear in T (a GPU kernel's tiles of query rows, a quantized step): every width
            for T in buckets(block):
                if (B, T) not in targets:
                    targets[(B, T)] = passes.target(T)
        if engine.drafter is not None and B not in drafts:
            drafts[B] = passes.draft()
        del passes


def _batch_sizes(batch_size: int, quick: bool) -> set:
    """The batch sizes passes are timed at: 1 and the job's. Where passes compile at
    ``compiled.MAX_ROWS`` rows or fewer (a GPU's: engine/ops/compiled.py), a wider job's second size is the narrowest that
    runs eagerly instead of 1: tracing a pass of so few rows is most of a fresh machine's warm-up
    (docs/results/warm-up-breakdown.md), and such a job runs none unless its tail shrinks there,
    where its cycles teach the cost model what they cost (engine/widths.py)."""
    if quick or compiled.mode() != "compiled" or batch_size <= compiled.MAX_ROWS:
        return {1, batch_size}
    return {compiled.MAX_ROWS + 1, batch_size}


def _quick() -> bool:
    """Whether passes are timed the CPU's way (module doc): nothing compiled, at two widths."""
    return device.on_cpu()


def _first_widths(B: int, block: int, quick: bool, alone: bool = False) -> list:
    """The verify widths timed at batch size B before any linearity check. A GPU times three at
    the job's batch size, a job of one row (``alone``) included: at batch 1 a pass of a small
    target is mostly kernel launches, so T > 1 costs about the same at every width and the line
    through T = 1 and the block overrates the widths between. On the CPU, a job of one row also
    times the block: there a pass's fixed cost of reading the weights shades into compute as T
    grows, so its cost is not a line in T at batch 1; at batch 8 it is one (the default pair's
    figures: docs/results/engine-floors.md)."""
    if quick:
        return sorted({1, min(PROBE_WIDTH, block)} | ({block} if alone else set()))
    return sorted({1, bucket(block // 2, block), block} if B > 1 or alone else {1, block})


def _straight(points, tolerance: float = 0.1) -> bool:
    """Whether the middle of three (x, seconds) points lies within ``tolerance`` of the line
    through the outer two."""
    (x0, y0), (x1, y1), (x2, y2) = sorted(points)
    if x2 == x0:
        return True
    line = y0 + (y2 - y0) * (x1 - x0) / (x2 - x0)
    return abs(y1 - line) <= tolerance * line


def _routes_differ() -> bool:
    """Whether the two ragged routes run different code here (a kernel against stock SDPA)."""
    return attention.mode() == "kernel" and device.gpu() is not None


def _matmul_differs() -> bool:
    """Whether the few-row matmul runs a kernel here, where MLX's matmul would run otherwise."""
    return matmul.mode() == "kernel" and device.backend() == "cuda"


class _Passes:
    """A batch of B rows holding about n tokens each (rows n, n - 1, n - 2, n - 3, ...), whose
    target and drafter passes can be timed; nothing is kept between passes but the context rows
    a verify pass tapped, the drafter's new context in its timed pass."""

    def __init__(self, engine, B: int, n: int):
        self.engine, self.B, self.quick = engine, B, _quick()
        target = engine.target
        block = max(engine.block_size, 2)
        self.rows = [max(n - b % 4, 1) for b in range(B)]
        # as the job's batch allocates it
        self.capacity = compiled.capacity(B, round_up(n + 2 * block))
        self.lengths = Lengths(self.rows)
        self.cache = target.make_cache(self.lengths, self.capacity)
        self.ids = mx.array(
            [[(7 * i + b) % target.vocab_size for i in range(block)] for b in range(B)],
            dtype=mx.int32,
        )
        # the drafter's new context: rows tapped by a verify of this width (the widest timed)
        self.context_rows = min(PROBE_WIDTH, block) if self.quick else block
        self.hidden = None

    def prime(self) -> None:
        """One untimed pass: what a process pays once at its first pass of a batch this wide (up to
        several passes' worth on a CPU; not the BLAS's start: a matmul first does not take it)
        is the job's cost either way, not a pass's."""
        mx.eval(self._verify(1)())

    def target(self, T: int) -> float:
        return _time(self._verify(T), quick=self.quick)

    def _verify(self, T: int) -> Callable:
        """A verify pass of T rows and its rollback, as a cycle runs them."""
        target, cache, tokens = self.engine.target, self.cache, self.ids[:, :T]

        keep = [1 + b % T for b in range(self.B)]  # rows keep what they accepted, as in a cycle

        def run():
            out, hidden = target.decode_pass(tokens, cache)
            # the rollback is part of a cycle's cost: recurrent layers replay the kept steps of
            # each row (engine/models/hybrid.py); attention layers need nothing (the lengths stay)
            target.rollback(cache, keep)
            if T == self.context_rows and hidden is not None:
                self.hidden = hidden  # kept for the drafter's timed pass
            return [out] + [
                x
                for c in cache
                if isinstance(c, hybrid.TapeCache)
                for x in c.cache
                if x is not None
            ]

        return run

    def draft(self) -> float:
        run = self._draft()
        if compiled.mode() == "compiled":
            # untimed: the drafter's first pass under a routing runs eagerly, so that _time's
            # compiling run is the trace and the runs it times are replays
            mx.eval(run())
        return _time(run, quick=self.quick)

    def _draft(self) -> Callable:
        """A drafter pass over the new context rows a verify pass tapped, as a cycle runs it (the
        draft cache's lengths stay: every run writes the same columns)."""
        engine, target, drafter = self.engine, self.engine.target, self.engine.drafter
        if self.hidden is None:  # no verify of that width timed: one untimed
            _, self.hidden = target.verify(self.ids[:, : self.context_rows], self.cache)
            target.rollback(self.cache, [self.context_rows] * self.B)
        draft_cache = drafter.make_cache(Lengths(self.rows), self.capacity)
        drafter.add_context(self.hidden, draft_cache)  # as a joining prompt does
        mx.eval(self.hidden, [c.arrays() for c in draft_cache])  # not part of the timed pass
        last, block = self.ids[:, :1], max(engine.block_size, 2)
        # the new context as a cycle hands it over, packed from the pieces earlier cycles left (a
        # drafting cycle's, of which each row kept all but one row, and a plain cycle's): pieces
        # of unequal rows are gathered, and a process's first gather took seconds on a GPU
        # (docs/results/slow-probe-h200-2026-11-28.md), which a job's drafting cycle paid before
        S = self.context_rows
        pieces = [(self.hidden, [S - 1] * self.B), (self.hidden[:, :1], [1] * self.B)]

        def drafting():
            """The arguments of a cycle's drafting, chain or tree."""
            context, _ = decode.pack_context(pieces)
            return (drafter, target, last, context, None, draft_cache, block - 1)

        if tree.drafts(drafter, target, engine.settings.drafts) != "tree":
            return lambda: decode.draft_block(*drafting(), head=engine.draft_head)

        def grow():
            # a tree cycle's drafting: each position's candidates, and the trees grown on the host
            ids, logprobs = decode.draft_candidates(
                *drafting(), tree.CANDIDATES, head=engine.draft_head
            )
            mx.eval(ids, logprobs)
            tree.best_first([0] * self.B, np.array(ids), np.array(logprobs), [block - 1] * self.B)
            return ids

        return grow


def _time(run: Callable, reps: int = 3, enough: float = 0.25, quick: bool = False) -> float:
    """The fastest of ``reps`` runs after a compiling one; a pass slow enough that its runs have
    taken ``enough`` seconds stops there (a CPU warm-up must not cost a job's worth). ``quick``
    (nothing to compile: the CPU): the first run counts (``_fastest_of_few``), unless it took
    under CHEAP_PASS seconds (a tiny model, whose first run's one-off costs would swamp the
    pass): then as above."""
    first = _run_once(run)  # compiles, if anything does
    if quick and first >= CHEAP_PASS:
        return _fastest_of_few(run, first)
    times = []
    for _ in range(reps):
        times.append(_run_once(run))
        if sum(times) >= enough:
            break
    return min(times)


def _fastest_of_few(run: Callable, first: float) -> float:
    """A CPU pass timed ``first`` seconds once: the fastest of that and one more run, and of a
    third where those two differ by more than AGREE (both may have been slowed): 2 runs a pass,
    3 at most. One run alone, taken in a load spike, priced the plain cycle several times too
    dear, and the table it went into serves every later process on the machine
    (engine/cost_tables.py). The fastest, not the median: other work on the machine only ever
    adds time to a pass (a median of three keeps a spike that hit two of them), and the load
    that lasts through a job is learnt from the job's own cycles (the cost model's excess, and
    the width policy's plain probes for the width-1 cost): two runs slowed alike are taken as the
    machine's speed."""
    times = [first, _run_once(run)]
    if max(times) > (1 + AGREE) * min(times):
        times.append(_run_once(run))
    return min(times)


def _run_once(run: Callable) -> float:
    start = time.perf_counter()
    mx.eval(run())
    return time.perf_counter() - start
