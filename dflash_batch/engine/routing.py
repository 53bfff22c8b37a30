"""The engine's op routing switched off: for code that must run MLX's own ops on a model the engine
holds (mlx-lm's generate functions, the benchmarks' baselines).

The engine routes multi-row attention for every model of the same architecture in the process
(``attention.install`` patches the model file) and the few-row products of the models it holds
(``matmul.install``); ``stock_ops`` sets both to "stock" for the block and restores them after.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from . import attention, matmul


@contextmanager
def stock_ops() -> Iterator[None]:
    saved = [(module, module.mode()) for module in (attention, matmul)]
    for module, _ in saved:
        module.set_mode("stock")
    try:
        yield
    finally:
        for module, mode in saved:
            module.set_mode(None if mode == module.default_mode() else mode)


__all__ = ["stock_ops"]
