"""Which matmul a linear layer runs on a few rows: MLX's, or the few-row kernel.

At batch 1 a verify pass runs each linear layer of the target on the T rows it verifies, and
the drafter runs its layers on a block of 16. MLX's CUDA backend sends one row to its gemv and
two or more to cuBLAS, which costs about twice as much per product at these sizes
(``kernels/matmul.py``). Routing sends products of MIN_ROWS..MAX_ROWS rows of an unquantized
weight of at most MAX_OUTPUTS rows to ``kernels.matmul``; everything else (one row, prefill
chunks, wide batches, LM heads, quantized layers) runs as before, through the layer's own code.

Modes (``Routes.matmul``: ``EngineConfig(matmul=...)``, else DFLASH_BATCH_MATMUL):
    stock    MLX's matmul everywhere (the default on the CPU and on Metal)
    kernel   the CUDA kernel for few-row products (the default on CUDA), after its self-check
             (``kernels.matmul.kernel_verified``: once per machine and dtype; a kernel that fails
             it warns once and MLX's matmul runs in its place)

Why it is the default on CUDA (docs/results/batched.md, "A few-row matmul kernel", with the figures):
the kernel takes less device time per product than cuBLAS but more host time per call, and a
verify pass at batch 1 is as much host as device, so a pass timed alone costs about the same; in
decoding, where the host builds the verify graph while the device drafts, the engine at batch 1
was faster with it, and a batch of 8 ran the same. On a larger model's layers cuBLAS is faster
at the same rows, so the warm-up times the job's few-row pass both ways and the job runs under the
faster (engine/warmup.py; docs/results/never-loses.md has the figures).

``install`` re-classes, in place, the ``nn.Linear`` layers of a model as ``RoutedLinear``: the same
parameters, the same module tree; only ``__call__`` asks the route first.
"""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import device, switch
from .kernels import matmul as kernel

ROUTE = switch.BY_FIELD["matmul"]
MODES = tuple(ROUTE.modes)
ENV = ROUTE.env
# Where the kernel beats MLX's matmul (benchmarks/small_matmul.py): 2 to 16 rows, and outputs up
# to a layer's width; one row is MLX's gemv, and over an LM head's width cuBLAS is faster from a
# few rows on (the kernel re-reads x for every pair of columns).
MIN_ROWS = 2
MAX_ROWS = 16
MAX_OUTPUTS = 8192

_counts: Dict[str, int] = {"routed": 0}
default_mode = ROUTE.default  # the variable if set, else "kernel" on CUDA and "stock" elsewhere


def mode() -> str:
    """The mode in force (``switch.current``)."""
    return switch.current().matmul


def counters() -> Dict[str, int]:
    """How many products went to the kernel."""
    return dict(_counts)


def _routed(x: mx.array, w: mx.array) -> bool:
    if switch.current().matmul != "kernel":
        return False
    rows = x.size // x.shape[-1] if x.ndim else 0
    return (
        MIN_ROWS <= rows <= MAX_ROWS
        and w.ndim == 2
        and w.shape[0] <= MAX_OUTPUTS
        and x.dtype == w.dtype
        and x.dtype in kernel.DTYPES
        and device.backend() == "cuda"
        and kernel.kernel_verified(x.dtype)
    )


def linear(x: mx.array, w: mx.array, bias: Optional[mx.array] = None) -> mx.array:
    """``x @ w.T (+ bias)``, through the kernel where routed."""
    if _routed(x, w):
        _counts["routed"] += 1
        y = kernel.matmul_kernel(x, w)
        return y if bias is None else y + bias
    return x @ w.T if bias is None else mx.addmm(bias, x, w.T)


class RoutedLinear(nn.Linear):
    """``nn.Linear`` whose few-row products may run the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        return linear(x, self["weight"], self.get("bias"))  # unrouted: the same ops as nn.Linear


def install(model: nn.Module) -> int:
    """Re-class the plain ``nn.Linear`` layers of ``model`` (not subclasses: quantized layers keep
    their own matmul); returns how many. Harmless in "stock" mode: the layers' own code runs."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RoutedLinear
            count += 1
    return count


__all__ = [
    "ENV",
    "MAX_OUTPUTS",
    "MAX_ROWS",
    "MIN_ROWS",
    "MODES",
    "RoutedLinear",
    "counters",
    "default_mode",
    "install",
    "linear",
    "mode",
]
