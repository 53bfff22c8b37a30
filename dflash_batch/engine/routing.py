"""The engine's op routing, set for a block of code: switched off for code that must run MLX's own
ops on a model the engine holds (mlx-lm's generate functions, the benchmarks' baselines), or one
mode chosen for an A/B run.

The engine routes multi-row attention for every model of the same architecture in the process
(``attention.install`` patches the model file) and the few-row products of the models it holds
(``matmul.install``), may replay its decoding passes from a trace (``compiled``) and verifies
chains or draft trees (``tree``). ``modes`` sets any of these for a block (``attention=``,
``matmul=``, ``passes=``, ``drafts=``, ``cpu_ops=``) and restores them after;
``stock_ops`` sets attention and matmul to "stock" and the CPU ops to MLX's own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from . import tree
from .ops import attention, compiled, matmul
from .ops.kernels import cpu


@contextmanager
def modes(**chosen: str) -> Iterator[None]:
    """Set the modes named (``attention=...``, ``matmul=...``, ``passes=...``, ``drafts=...``,
    ``cpu_ops=...``) for the block; restore after."""
    saved = [(module, module.mode()) for module in (_MODULES[name] for name in chosen)]
    for (module, _), mode in zip(saved, chosen.values()):
        module.set_mode(mode)
    try:
        yield
    finally:
        for module, mode in saved:
            module.set_mode(None if mode == module.default_mode() else mode)


def stock_ops():
    """MLX's own attention, matmul and CPU ops for the block."""
    return modes(attention="stock", matmul="stock", cpu_ops="mlx")


_MODULES = {"attention": attention, "matmul": matmul, "passes": compiled, "drafts": tree, "cpu_ops": cpu}

__all__ = ["modes", "stock_ops"]
