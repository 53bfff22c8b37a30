"""How many sequences fit: cache bytes per row against the memory the device has free.

A row of n tokens holds, per attention layer of the target and of the drafter, K and V of n
positions (capacity grows in 256-column steps), plus, per GatedDeltaNet layer, its conv and
recurrent state. The plan is made before any work, from the longest request of the job, so
a job never runs out of memory halfway through. A stream of requests (``Plan``) is planned from
the memory free when it starts and the longest request seen so far: a longer one that arrives
later lowers the rows in flight (the batch narrows before it joins).
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from .. import environment
from ..completion import GenerationError
from .ops import device
from .ops.batch_cache import Lengths, RaggedKVCache, round_up

USABLE = 0.8  # of free memory, for caches and the passes' temporaries
ENV_LIMIT = "DFLASH_BATCH_MEMORY_GB"  # overrides the device's own figure (e.g. to share a GPU)


def default_batch_cap() -> int:
    return 16 if device.on_cpu() else 32


def default_prefill() -> tuple:
    """(prompt tokens per prefill pass of one prompt, most tokens in one packed pass). On a CPU
    a pass's attention scores (chunk x keys, per head) must stay in cache, so a long prompt
    prefills faster in chunks of 512 than in one pass, and packed passes of a few prompts are
    faster capped at 4,096 tokens than at 8,192 (the measurements, with their command:
    docs/results/engine-floors.md)."""
    return (512, 4096) if device.on_cpu() else (2048, 8192)


def total_bytes() -> int:
    """The memory MLX may use: $DFLASH_BATCH_MEMORY_GB, else the device's figure (the
    recommended working set on Metal), else the machine's RAM."""
    gigabytes = environment.get(ENV_LIMIT)
    if gigabytes:
        return int(gigabytes * 1e9)
    info = mx.device_info() if not device.on_cpu() else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_bytes() -> int:
    return max(total_bytes() - mx.get_active_memory(), 0)


def rows_that_fit(per_row: int) -> int:
    return int(free_bytes() * USABLE // max(per_row, 1))


class Plan:
    """Rows in flight for requests of up to ``longest`` positions: at most ``rows`` (the asked
    cap), at most what the memory free when the plan was made holds at that length."""

    def __init__(self, engine, cap: int):
        self.engine, self.rows, self.longest = engine, cap, 0
        self.free = free_bytes()

    def take(self, tokens: int) -> None:
        """Make room for a request of ``tokens`` positions (prompt, budget and a block): a longer
        one than any before lowers ``rows`` to what fits; raises GenerationError when not even
        one row of it fits."""
        if tokens <= self.longest:
            return
        per_row = row_bytes(self.engine, tokens)
        fits = int(self.free * USABLE // max(per_row, 1))
        if fits < 1:
            raise GenerationError(
                f"not enough memory for one sequence of {tokens} tokens: it needs {per_row / 1e9:.2f} GB "
                f"of cache, {self.free / 1e9:.2f} GB are free (lower max_tokens or use a smaller model)"
            )
        self.longest, self.rows = tokens, min(self.rows, fits)


def row_bytes(engine, tokens: int) -> int:
    """Cache bytes one row of ``tokens`` positions needs in the target and the drafter."""
    per_position, fixed = 0, 0
    for layer, cache in zip(engine.target.layers, engine.target.make_cache(Lengths([0]))):
        if isinstance(cache, RaggedKVCache):
            per_position += _kv_bytes(layer.self_attn)
        else:  # GatedDeltaNet: conv state (activations) and recurrent state (fp32)
            gdn = layer.linear_attn
            fixed += (gdn.conv_kernel_size - 1) * gdn.conv_dim * _itemsize(gdn.in_proj_qkv)
            fixed += gdn.num_v_heads * gdn.head_v_dim * gdn.head_k_dim * 4
    if engine.drafter is not None:
        per_position += sum(_kv_bytes(layer.self_attn) for layer in engine.drafter.layers)
    return per_position * round_up(tokens) + fixed


def _kv_bytes(attn: nn.Module) -> int:
    """K and V bytes of one position: k_proj's and v_proj's output features (gemma4_text's
    full-attention layers with K = V have no v_proj: the keys serve as values, stored twice)."""
    k = attn.k_proj
    v = getattr(attn, "v_proj", k)
    return (_out_features(k) + _out_features(v)) * _itemsize(k)


def _out_features(linear: nn.Module) -> int:
    return linear.weight.shape[0]


def _itemsize(linear: nn.Module) -> int:
    """Bytes of one activation through this layer (its scales' dtype when quantized)."""
    dtype = getattr(linear, "scales", linear.weight).dtype
    return mx.float32.size if dtype == mx.float32 else dtype.size
