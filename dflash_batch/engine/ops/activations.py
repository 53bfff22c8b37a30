"""Which SwiGLU the target's MLPs run: mlx-lm's, or the CPU ops' (``kernels/cpu.py``: the same
values, a thirtieth of the time on a Linux CPU).

mlx-lm model files (llama, qwen2, qwen3, ...) call ``swiglu`` imported by name from
``mlx_lm.models.activations``; ``install`` points that name, in the model's own modules, at
``routed_swiglu``, which runs mlx-lm's own wherever the CPU ops are not active (a GPU, macOS,
``switch.stock_ops()``).
"""

from __future__ import annotations

from typing import List

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as mlx_lm_activations

from . import switch
from .kernels import cpu

_stock_swiglu = mlx_lm_activations.swiglu


def routed_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """Drop-in for ``mlx_lm.models.activations.swiglu``."""
    if cpu.active():
        return cpu.swiglu(gate, x)
    return _stock_swiglu(gate, x)


def install(model: nn.Module) -> List[str]:
    """Point the MLPs of an mlx-lm model at ``routed_swiglu``; returns the modules patched (none
    when already installed)."""
    return switch.repoint(model, "swiglu", _stock_swiglu, routed_swiglu)


__all__ = ["install", "routed_swiglu"]
