"""Decoding passes built once per shape and replayed: ``mx.compile`` over the target's verify pass
and the drafter's pass.

At batch 1 on a GPU a verify pass is as much host as device: every cycle the host builds, in
Python, a graph of some thousand operations, a large share of the pass (docs/results/batched.md, "A
few-row matmul kernel", with its measurements). A compiled pass is traced once per shape; later
calls replay MLX's own record of it, with its elementwise chains fused, and the custom kernels' calls are built once.

Its shapes must not change from cycle to cycle, so the pass sees the batch's K/V buffers whole,
at a fixed width, with the rows' lengths n_b as a device array: the ragged batch's pass
(engine/ops/batch_cache.py) at a width that stays put:

    write:   row b's T new keys and values at columns n_b .. n_b + T - 1     (a scatter)
    RoPE:    positions n_b + i                                            (a per-row offset)
    attend:  all ``width`` columns; query i of row b sees key j iff j <= n_b + i

A draft tree's pass (engine/tree.py) compiles too, as a trace of its own: its nodes' depths
[B, T] and ancestors [B, T, T] are inputs beside the lengths, RoPE takes positions n_b + depth
and attention the tree's mask over the whole buffer (``tree_visible``).

A batch that compiles allocates its buffers on a ladder of widths (``capacity``: 512, 1024,
2048, 4096 positions), so the next job's passes of the same rows and width replay the same
trace. Wider caches, more than MAX_ROWS rows, plain one-token steps, GatedDeltaNet targets (their
tape) and prefill run eagerly, as before.

What it saves the host, and the engine's speed with and without it: docs/batched.md,
"Compiled passes".

Modes (``Routes.passes``: ``EngineConfig(passes=...)``, else DFLASH_BATCH_PASSES):
    eager      the pass is built in Python every time (the default on the CPU and on Metal)
    compiled   traced once per key and shape (the default on CUDA)

A trace depends on the routing in force (attention mode and ragged route, matmul mode: chosen
in Python while tracing), so each combination has its own compiled function. The first pass
under a new combination runs eagerly through the same view: the kernels' self-checks evaluate
arrays, which a trace cannot.

The drafter's pass (``CompiledDraft``, mostly host time at batch 1 when built eagerly every
cycle) compiles the same way, under the same mode, rows and ladder. Its shapes change
from cycle to cycle twice over: the new context rows S (what the last cycle kept, more after
plain cycles) and the draft cache's keys. Both are fixed here: the context is padded to P = the
drafter's block size rows, with each row's count c_b on the device, and the cache is seen whole.
The pass is the drafter's ragged one (engine/models/drafter.py: ``Attention._ragged``), for L block rows:

    context row j of row b -> column n_b + j           (j < c_b: the rows the engine counts)
    padding row j          -> column n_b + L + j       (j >= c_b: past the block, never counted)
    block row i            -> column n_b + c_b + i     (queries at those positions too)
    attend:                   row b's keys j < n_b + c_b + L, over all ``width`` columns

so below each row's new length n_b + c_b it leaves exactly what the eager pass leaves; past it,
scratch that the next pass overwrites before it reads it. The LM head stays outside (its rows
follow the verify width). More than P new rows, a batch with no room for the P padding rows,
and caches off the ladder take the eager pass (its cost against the eager pass: docs/batched.md,
"Compiled passes").
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from . import switch
from .batch_cache import RaggedKVCache, put_columns, tree_visible, visible
from .rope import TokenPositions

ROUTE = switch.BY_FIELD["passes"]
MODES = tuple(ROUTE.modes)
ENV = ROUTE.env
MAX_ROWS = 8  # wider batches are device-bound: building their graph is a small part of a pass
# a plain step (T = 1) stays eager: stock SDPA's one-row kernel over the live keys costs
# the device less than the routed attention over the whole buffer, by more than
# the host would save (docs/batched.md, "Compiled passes")
MIN_WIDTH = 2
# buffer widths a compiling batch allocates; wider caches stay eager
LADDER = (512, 1024, 2048, 4096)

default_mode = ROUTE.default  # the variable if set, else "compiled" on CUDA and "eager" elsewhere


def mode() -> str:
    """The mode in force (``switch.current``)."""
    return switch.current().passes


def capacity(rows: int, positions: int) -> int:
    """The key positions a batch of ``rows`` allocates for rows of up to ``positions``: the ladder's
    rung at or above it when its passes compile, else ``positions`` (eager passes cut their keys
    to the rows' lengths, so a wider buffer would only cost memory)."""
    if mode() != "compiled" or rows > MAX_ROWS:
        return positions
    return next((rung for rung in LADDER if rung >= positions), positions)


class _Lengths:
    """The rows' lengths as the pass sees them: a device array only (``Lengths`` in a trace)."""

    uniform = False

    def __init__(self, device: mx.array, tree: Optional[Tuple[mx.array, mx.array]] = None):
        self.device = device
        self.tree = tree  # a draft tree's pass: (depth [B, T], ancestors [B, T, T]), engine/tree.py

    def columns(self, T: int) -> mx.array:
        return self.device[:, None] + mx.arange(T, dtype=mx.int32)[None]


class _FixedWidthView(RaggedKVCache):
    """One attention layer's K/V inside a compiled pass: the whole buffer, written by scatter."""

    def __init__(
        self, lengths: _Lengths, keys: mx.array, values: mx.array, window: Optional[int] = None
    ):
        super().__init__(lengths, window=window)
        self.keys, self.values = keys, values

    @property
    def offset(self):
        if self.lengths.tree is not None:  # one RoPE position per node: n_b + its depth
            return TokenPositions(self.lengths.device[:, None] + self.lengths.tree[0])
        return self.lengths.device

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        T = keys.shape[2]
        return self.write_columns(self.lengths.columns(T), keys, values, T)

    def write_columns(self, columns: mx.array, keys: mx.array, values: mx.array, reach: int):
        """Scatter keys [B, H, T, D] to columns [B, T] per row; the whole buffers to attend over
        (the pass masks them per row: ``reach`` is the eager cache's, unused)."""
        self.keys = put_columns(self.keys, columns, keys)
        self.values = put_columns(self.values, columns, values)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        window = window_size or self.window
        if self.lengths.tree is not None:
            if window:
                raise ValueError(
                    "draft trees are verified on full-attention layers only (no sliding window)"
                )
            return tree_visible(self.lengths.device, self.lengths.tree[1], self.keys.shape[2])
        return visible(self.lengths.device, N, self.keys.shape[2], window=window)


def _fixed_width(cache: list, reach: int) -> bool:
    """Whether a pass can see ``cache`` whole: every layer's buffers allocated, at one width of
    the ladder, for at most MAX_ROWS rows, with room for the pass's writes ``reach`` columns
    past the longest row."""
    if not cache or not all(type(c) is RaggedKVCache and c.keys is not None for c in cache):
        return False
    lengths, width = cache[0].lengths, cache[0].keys.shape[2]
    return (
        len(lengths) <= MAX_ROWS
        and width in LADDER
        and lengths.max + reach <= width
        and all(c.keys.shape[2] == width for c in cache)
    )


class _Traces:
    """A pass's compiled functions, one per routing, and counts of how it ran."""

    def __init__(self):
        self._compiled: Dict[tuple, object] = {}  # routing -> mx.compile(self._pass)
        # passes run each way (the first of a routing: eager)
        self.calls = {"compiled": 0, "eager": 0}
        self.traced = 0  # times the pass's Python ran: traces, and the eager first passes

    def _run(self, kind: str = ""):
        """The pass to call now: this routing's trace, or, the first time under a routing, the pass
        itself run eagerly, so that kernels check themselves outside a trace. ``kind`` keeps
        passes of other inputs apart (a draft tree's)."""
        routes = switch.current()
        routing = (routes.attention, routes.ragged, routes.matmul, kind)
        run = self._compiled.get(routing)
        if run is None:
            self._compiled[routing] = mx.compile(self._pass)
            run, kind = self._pass, "eager"
        else:
            kind = "compiled"
        self.calls[kind] += 1
        return run


class CompiledPasses(_Traces):
    """A target's decoding pass (``Target.decode_pass``), compiled where it can be."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def applies(self, cache: list, T: int) -> bool:
        """Whether a pass of T rows over ``cache`` runs compiled (module doc)."""
        return (
            mode() == "compiled"
            and T >= MIN_WIDTH
            and not self.target.hybrid
            and _fixed_width(cache, T)
        )

    def __call__(self, tokens: mx.array, cache: list) -> Tuple[mx.array, Optional[mx.array]]:
        """logits [B, T, V] and the tapped hidden states, as ``Target.verify`` gives them; the
        cache's buffers hold the pass's keys and values after it (the caller advances lengths)."""
        if not self.applies(cache, tokens.shape[1]):
            return self.target.verify(tokens, cache)
        lengths = cache[0].lengths
        args = (tokens, lengths.device, [c.keys for c in cache], [c.values for c in cache])
        if lengths.tree is None:
            logits, hidden, keys, values = self._run()(*args)
        else:  # a draft tree's pass: its nodes' depths and ancestors are inputs too
            logits, hidden, keys, values = self._run("tree")(*args, *lengths.tree)
        _reassign(cache, keys, values)
        return logits, (hidden[0] if hidden else None)

    def _pass(
        self,
        tokens: mx.array,
        lengths: mx.array,
        keys: List[mx.array],
        values: List[mx.array],
        depth: Optional[mx.array] = None,
        ancestors: Optional[mx.array] = None,
    ):
        self.traced += 1
        view = _Lengths(lengths, None if depth is None else (depth, ancestors))
        windows = self.target.windows()
        cache = [_FixedWidthView(view, k, v, w) for k, v, w in zip(keys, values, windows)]
        logits, hidden = self.target(tokens, cache)
        return (
            logits,
            ([] if hidden is None else [hidden]),
            [c.keys for c in cache],
            [c.values for c in cache],
        )


class CompiledDraft(_Traces):
    """A drafter's pass (``drafter.Model.draft_pass``), compiled where it can be (module doc)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter
        self.rows = drafter.args.block_size  # P: new context rows a compiled pass takes, padded

    def applies(self, x: mx.array, context: mx.array, cache: list) -> bool:
        """Whether the pass of block ``x`` [B, L, H] with new ``context`` rows [B, S, .] runs
        compiled: at most P rows, and room for the furthest write, row b's last padding row at
        n_b + L + P - 1."""
        return (
            mode() == "compiled"
            and context.shape[1] <= self.rows
            and _fixed_width(cache, x.shape[1] + self.rows)
        )

    def __call__(
        self, x: mx.array, context: mx.array, cache: list, counts: Optional[mx.array] = None
    ) -> mx.array:
        """hidden [B, L, H], as ``drafter(x, context, cache, counts)`` gives it; the cache's buffers
        hold the pass's context rows after it (the caller advances the lengths by the counts)."""
        if not self.applies(x, context, cache):
            return self.drafter(x, context, cache, counts)
        B, S, _ = context.shape
        if counts is None:  # every row brings all S rows
            counts = mx.full((B,), S, dtype=mx.int32)
        if S < self.rows:  # padding rows: never counted (module doc), so zeros do
            context = mx.pad(context, [(0, 0), (0, self.rows - S), (0, 0)])
        hidden, keys, values = self._run()(
            x,
            context,
            counts,
            cache[0].lengths.device,
            [c.keys for c in cache],
            [c.values for c in cache],
        )
        _reassign(cache, keys, values)
        return hidden

    def _pass(
        self,
        x: mx.array,
        context: mx.array,
        counts: mx.array,
        lengths: mx.array,
        keys: List[mx.array],
        values: List[mx.array],
    ):
        self.traced += 1
        view = _Lengths(lengths)
        cache = [_FixedWidthView(view, k, v) for k, v in zip(keys, values)]
        # counts given: the ragged path, write_columns
        hidden = self.drafter(x, context, cache, counts)
        return hidden, [c.keys for c in cache], [c.values for c in cache]


def _reassign(cache: list, keys: List[mx.array], values: List[mx.array]) -> None:
    """The pass's buffers into the cache; the old buffers' last references go, so the scatter
    writes in place."""
    for c, k, v in zip(cache, keys, values):
        c.keys, c.values = k, v


__all__ = [
    "CompiledDraft",
    "CompiledPasses",
    "ENV",
    "LADDER",
    "MAX_ROWS",
    "MIN_WIDTH",
    "MODES",
    "capacity",
    "default_mode",
    "mode",
]
