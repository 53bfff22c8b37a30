"""Which attention a verify or draft pass runs: stock SDPA or the two-pass block attention.

On MLX's CUDA backend, ``mx.fast.scaled_dot_product_attention`` with more than one query row
costs tens of milliseconds whenever the key length differs from the previous call, a fraction
of one when it repeats (docs/gpu-attention.md). A DFlash cycle grows the KV cache every time, so
every verify pass and every draft pass would pay it. Routing sends attention with 2..MAX_ROWS
query rows to ``kernels.attention.block_attention_*``, whose kernels are compiled once per dtype and head dim.
Single-row decode steps and long prefill chunks keep stock SDPA.

Modes (``Routes.attention``: ``EngineConfig(attention=...)``, else DFLASH_BATCH_ATTENTION):
    stock      stock SDPA everywhere (default on CPU, and on Metal, where the kernels are untested)
    kernel     the CUDA / Metal kernels (default on CUDA), each after its self-check
               (``block.kernel_verified``: once per machine and kind of call; a kernel that fails
               it warns once and the reference runs in its place)
    reference  the same two passes in MLX ops (any backend; used by the tests)

Ragged batches (rows of their own lengths: ``RaggedKVCache``) have a second choice, the
*ragged route* (``Routes.ragged``, a field of the engine's cost model): "block" sends them to
the block attention above with per-row key lengths; "sdpa" to stock SDPA over the cache's bucketed key width (a multiple of 256,
so few distinct shapes per job) with a per-row bool mask. Which is faster depends on the backend,
the batch and the context (stock SDPA's fused multi-row path against our kernels), so the engine
times both at warm-up (``engine/warmup.py``) and keeps the faster for its passes of several rows;
plain one-row steps stay on "block", the route of an engine without a drafter.

The target's attention layers reach the op through ``install``: mlx-lm model files call
``scaled_dot_product_attention`` imported by name from ``mlx_lm.models.base``; ``install``
points that name, in the model's own modules, at ``target_sdpa``, which falls back to the
original for everything it does not route (one row, array masks, quantized caches; attention
sinks unless the mode is "reference").
The drafter calls ``drafter_attention`` directly.

On a Linux CPU what is not routed runs MLX's own composed attention with the softmax of
``kernels/cpu.py`` (``kernels.cpu.sdpa``: the same values, a tenth of the softmax's time) for
the engine's passes (``RaggedKVCache``) and the drafter's.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.base import create_causal_mask

from . import device, switch
from .batch_cache import RaggedKVCache
from .kernels import attention as block
from .kernels import cpu

ROUTE = switch.BY_FIELD["attention"]
MODES = tuple(ROUTE.modes)
RAGGED_ROUTES = switch.RAGGED_ROUTES
ENV = ROUTE.env
MAX_ROWS = 64  # more query rows than this (prefill chunks) stay on stock SDPA

_stock_sdpa = mlx_lm_base.scaled_dot_product_attention
_counts: Dict[str, int] = {"routed": 0, "stock": 0}
default_mode = ROUTE.default  # the variable if set, else "kernel" on CUDA and "stock" elsewhere


def mode() -> str:
    """The mode in force (``switch.current``)."""
    return switch.current().attention


def ragged_route() -> str:
    """The ragged route in force (``switch.current``)."""
    return switch.current().ragged


def counters() -> Dict[str, int]:
    """How many attention calls went through the routed op and how many through stock SDPA."""
    return dict(_counts)


def _route(q: mx.array, k: mx.array, v: mx.array, min_rows: int = 2) -> Optional[str]:
    """The implementation to use for these arrays ("kernel" / "reference"), or None for stock."""
    chosen = switch.current().attention
    if chosen == "stock" or not min_rows <= q.shape[2] <= MAX_ROWS:
        return None
    if chosen == "kernel" and (device.gpu() is None or block.unsupported(q, k, v)):
        return None
    if chosen == "reference" and block.unsupported(q, k, v, head_dims=None):
        return None
    return chosen


def _block_attention(
    impl: str,
    q,
    k,
    v,
    scale: float,
    causal: bool,
    window: Optional[int],
    kv_len: Optional[mx.array] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    _counts["routed"] += 1
    if impl == "kernel" and block.kernel_verified(
        q, causal=causal, window=window, kv_start=None, kv_len=kv_len
    ):
        return block.block_attention_kernel(
            q, k, v, scale=scale, causal=causal, window=window, kv_len=kv_len, checked=True
        )
    return block.block_attention_reference(
        q, k, v, scale=scale, causal=causal, window=window, kv_len=kv_len, sinks=sinks
    )


def _route_sinks(
    q: mx.array, k: mx.array, v: mx.array, sinks: Optional[mx.array], min_rows: int = 2
):
    """``_route``, where attention sinks (gpt-oss) go to the reference only: the kernels take none,
    and stock SDPA handles them on every backend."""
    impl = _route(q, k, v, min_rows)
    return impl if sinks is None or impl == "reference" else None


def target_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """Drop-in for ``mlx_lm.models.base.scaled_dot_product_attention``.

    Routed: mask "causal" (rows causal inside the block, all earlier keys visible) or None
    (every row sees every key), plain (unquantized) caches, attention sinks in "reference" mode
    only; and the passes of a ragged batch (``RaggedKVCache`` rows of their own lengths: row b's
    keys end at ``lengths[b] + rows``), plain decoding steps included. A sliding-window layer's cache
    (``RaggedKVCache.window``) routes with its window, the one its mask carries. A draft tree's
    mask goes to stock SDPA.
    """
    ours = isinstance(cache, RaggedKVCache) and cache.lengths.tree is None
    # A plain step (one query row) takes the block route whatever the warm-up chose: the choice
    # is timed on drafting passes, and a plain cycle with a drafter attached must run as it runs
    # without one (where no warm-up ever sets the route). A draft tree's pass attends by its mask.
    if (
        ours
        and not cache.lengths.uniform
        and (switch.current().ragged == "block" or queries.shape[2] == 1)
    ):
        impl = _route_sinks(queries, keys, values, sinks, min_rows=1)
        if impl is not None:
            kv_len = cache.lengths.device + queries.shape[2]
            return _block_attention(
                impl,
                queries,
                keys,
                values,
                scale,
                causal=True,
                window=cache.window,
                kv_len=kv_len,
                sinks=sinks,
            )
    if (
        ours and cache.window and cache.lengths.uniform
    ):  # keys end at the last query, as the window counts
        impl = _route_sinks(queries, keys, values, sinks)
        if impl is not None:
            return _block_attention(
                impl, queries, keys, values, scale, causal=True, window=cache.window, sinks=sinks
            )
    plain_mask = mask is None or (isinstance(mask, str) and mask == "causal")
    if plain_mask and not hasattr(cache, "bits"):
        impl = _route_sinks(queries, keys, values, sinks)
        if impl is not None:
            return _block_attention(
                impl,
                queries,
                keys,
                values,
                scale,
                causal=mask is not None,
                window=None,
                sinks=sinks,
            )
    _counts["stock"] += 1
    if isinstance(cache, RaggedKVCache) and sinks is None and cpu.active():
        return cpu.sdpa(queries, keys, values, scale, mask)
    return _stock_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask) -> mx.array:
    """MLX's SDPA, with the CPU ops' softmax where they are active (the same values)."""
    if cpu.active():
        return cpu.sdpa(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def drafter_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    window: Optional[int],
    kv_len: Optional[mx.array] = None,
    causal: Optional[bool] = None,
) -> mx.array:
    """Draft-block attention over [context, block] keys: bidirectional (full layers), or causal
    within a sliding window (sliding layers); the block's rows are the last ``L`` key positions,
    or, in a ragged batch, the last of row b's first ``kv_len[b]`` keys. ``causal=False`` keeps a
    sliding layer's block bidirectional (DFlash 2: only the context is windowed)."""
    causal = window is not None if causal is None else causal
    if kv_len is not None:
        impl = _route(q, keys, values) if switch.current().ragged == "block" else None
        if impl is not None:
            return _block_attention(
                impl, q, keys, values, scale, causal=causal, window=window, kv_len=kv_len
            )
        _counts["stock"] += 1
        mask = _ragged_mask(kv_len, q.shape[2], keys.shape[2], causal, window)
        return _sdpa(q, keys, values, scale, mask)
    impl = _route(q, keys, values)
    if impl is not None:
        return _block_attention(impl, q, keys, values, scale, causal=causal, window=window)
    _counts["stock"] += 1
    mask = None
    L = q.shape[2]
    if window is not None and causal:
        mask = create_causal_mask(L, offset=keys.shape[2] - L, window_size=window)
    elif window is not None:
        mask = _ragged_mask(
            mx.array([keys.shape[2]], dtype=mx.int32), L, keys.shape[2], False, window
        )
    return _sdpa(q, keys, values, scale, mask)


def _ragged_mask(
    kv_len: mx.array, L: int, width: int, causal: bool, window: Optional[int]
) -> mx.array:
    """Bool [B, 1, L, width]: row b's query i sits at key position kv_len[b] - L + i and sees
    keys before kv_len[b] (and, causal, none after itself; with a window, the last ``window``)."""
    key = mx.arange(width, dtype=mx.int32)[None, None, None, :]
    end = kv_len[:, None, None, None]
    query = end - L + mx.arange(L, dtype=mx.int32)[None, None, :, None]
    ok = key < end
    if causal:
        ok = ok & (key <= query)
    if window:
        ok = ok & (key > query - window)
    return ok


def install(model: nn.Module) -> List[str]:
    """Point the attention layers of an mlx-lm model at ``target_sdpa``; returns the modules
    patched (none when already installed). Harmless in "stock" mode: the same SDPA runs."""
    return switch.repoint(model, "scaled_dot_product_attention", _stock_sdpa, target_sdpa)
