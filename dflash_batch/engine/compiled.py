"""Decoding passes built once per shape and replayed: ``mx.compile`` over the target's forward.

At batch 1 on a GPU a verify pass is as much host as device: every cycle the host builds, in
Python, a graph of 850-1,500 operations, 1.3-4.5 ms of a 4-10 ms pass on H200s (docs/batched.md,
"A few-row matmul kernel"). A compiled pass is traced once per shape; later calls replay MLX's
own record of it, with its elementwise chains fused, and the custom kernels' calls are built once.

Its shapes must not change from cycle to cycle, so the pass sees the batch's K/V buffers whole,
at a fixed width, with the rows' lengths n_b as a device array: the ragged batch's pass
(engine/batch_cache.py) at a width that stays put:

    write:   row b's T new keys and values at columns n_b .. n_b + T - 1     (a scatter)
    RoPE:    positions n_b + i                                            (a per-row offset)
    attend:  all ``width`` columns; query i of row b sees key j iff j <= n_b + i

A batch that compiles allocates its buffers on a ladder of widths (``capacity``: 512, 1024,
2048, 4096 positions), so the next job's passes of the same rows and width replay the same
trace. Wider caches, more than MAX_ROWS rows, plain one-token steps, GatedDeltaNet targets (their
tape) and prefill run eagerly, as before.

Measured on an H200 (default pair, batch 1; docs/batched.md, "Compiled passes"): a pass of 2-16
rows 4.0-6.7 ms against 7.1-9.3 eager, the host's share 0.6-0.75 ms against 3.4-3.6; the
adaptive engine 2.30x ``mlx_lm.stream_generate`` against 1.68x eager, in one process.

Modes (``set_mode``, or the environment variable DFLASH_BATCH_PASSES):
    eager      the pass is built in Python every time (the default on the CPU and on Metal)
    compiled   traced once per key and shape (the default on CUDA)

A trace depends on the routing in force (attention mode and ragged route, matmul mode: chosen
in Python while tracing), so each combination has its own compiled function. The first pass
under a new combination runs eagerly through the same view: the kernels' self-checks evaluate
arrays, which a trace cannot.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from . import attention, matmul
from .batch_cache import RaggedKVCache, visible
from .kernels import attention as block

MODES = ("eager", "compiled")
ENV = "DFLASH_BATCH_PASSES"
MAX_ROWS = 8  # wider batches are device-bound: building their graph is a small part of a pass
MIN_WIDTH = 2  # a plain step (T = 1) stays eager: stock SDPA's one-row kernel over the live keys costs
               # the device less than the routed attention over the whole buffer (H200: about 3.1
               # against 4.3 ms a pass), more than the host would save
LADDER = (512, 1024, 2048, 4096)  # buffer widths a compiling batch allocates; wider caches stay eager

_mode: Optional[str] = None  # as set; None: default_mode()


def default_mode() -> str:
    """DFLASH_BATCH_PASSES if set, else "compiled" on CUDA and "eager" elsewhere."""
    env = os.environ.get(ENV)
    if env and env not in MODES:
        raise ValueError(f"{ENV}={env!r}: expected one of {MODES}")
    return env or ("compiled" if block.gpu_backend() == "cuda" else "eager")


def set_mode(mode: Optional[str]) -> None:
    """Choose the mode for the whole process; None returns to the default."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"pass mode must be one of {MODES} or None, got {mode!r}")
    global _mode
    _mode = mode


def mode() -> str:
    return _mode or default_mode()


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

    def __init__(self, device: mx.array):
        self.device = device

    def columns(self, T: int) -> mx.array:
        return self.device[:, None] + mx.arange(T, dtype=mx.int32)[None]


class _FixedWidthView(RaggedKVCache):
    """One attention layer's K/V inside a compiled pass: the whole buffer, written by scatter."""

    def __init__(self, lengths: _Lengths, keys: mx.array, values: mx.array):
        super().__init__(lengths)
        self.keys, self.values = keys, values

    @property
    def offset(self) -> mx.array:
        return self.lengths.device

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        columns = self.lengths.columns(keys.shape[2])
        self.keys = _scatter(self.keys, columns, keys)
        self.values = _scatter(self.values, columns, values)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise ValueError("batched decoding supports full-attention layers only (no sliding window)")
        return visible(self.lengths.device, N, self.keys.shape[2])


def _scatter(buffer: mx.array, columns: mx.array, rows: mx.array) -> mx.array:
    """buffer[b, :, columns[b, t], :] = rows[b, :, t, :]."""
    B, H, T, D = rows.shape
    return mx.put_along_axis(buffer, mx.broadcast_to(columns[:, None, :, None], (B, H, T, D)), rows, axis=2)


class CompiledPasses:
    """A target's decoding pass (``Target.decode_pass``), compiled where it can be."""

    def __init__(self, target):
        self.target = target
        self._compiled: Dict[tuple, object] = {}  # routing -> mx.compile(self._pass)
        self.calls = {"compiled": 0, "eager": 0}  # passes run each way (the first of a routing: eager)
        self.traced = 0  # times the pass's Python ran: traces, and the eager first passes

    def applies(self, cache: list, T: int) -> bool:
        """Whether a pass of T rows over ``cache`` runs compiled (module doc)."""
        if mode() != "compiled" or T < MIN_WIDTH or self.target.hybrid or not cache:
            return False
        first = cache[0]
        if not all(type(c) is RaggedKVCache and c.keys is not None for c in cache):
            return False
        width = first.keys.shape[2]
        return (len(first.lengths) <= MAX_ROWS and width in LADDER and first.lengths.max + T <= width
                and all(c.keys.shape[2] == width for c in cache))

    def __call__(self, tokens: mx.array, cache: list) -> Tuple[mx.array, Optional[mx.array]]:
        """logits [B, T, V] and the tapped hidden states, as ``Target.verify`` gives them; the
        cache's buffers hold the pass's keys and values after it (the caller advances lengths)."""
        if not self.applies(cache, tokens.shape[1]):
            return self.target.verify(tokens, cache)
        routing = (attention.mode(), attention.ragged_route(), matmul.mode())
        run = self._compiled.get(routing)
        if run is None:  # first under this routing: eagerly, so that kernels check themselves outside a trace
            self._compiled[routing] = mx.compile(self._pass)
            run, kind = self._pass, "eager"
        else:
            kind = "compiled"
        self.calls[kind] += 1
        logits, hidden, keys, values = run(tokens, cache[0].lengths.device, [c.keys for c in cache],
                                           [c.values for c in cache])
        for c, k, v in zip(cache, keys, values):
            c.keys, c.values = k, v  # the old buffers' last references go: the scatter writes in place
        return logits, (hidden[0] if hidden else None)

    def _pass(self, tokens: mx.array, lengths: mx.array, keys: List[mx.array], values: List[mx.array]):
        self.traced += 1
        view = _Lengths(lengths)
        cache = [_FixedWidthView(view, k, v) for k, v in zip(keys, values)]
        logits, hidden = self.target(tokens, cache)
        return logits, ([] if hidden is None else [hidden]), [c.keys for c in cache], [c.values for c in cache]


__all__ = ["CompiledPasses", "ENV", "LADDER", "MAX_ROWS", "MIN_WIDTH", "MODES", "capacity", "default_mode", "mode", "set_mode"]
