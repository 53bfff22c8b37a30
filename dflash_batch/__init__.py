"""dflash-batch: offline batch generation on MLX with DFlash speculative decoding.

The engine (MLX) is imported only when it is used, so the runner and queue stay MLX-free.
"""

from .completion import Completion, GenerationError, GenerationStats, Piece

__version__ = "0.1.0"

_ENGINE_NAMES = {"load_engine", "Engine", "load_drafter", "load_target"}
_RUNNER_NAMES = {"submit", "run", "Job"}


def __getattr__(name):
    if name in _ENGINE_NAMES:
        from . import engine

        return getattr(engine, name)
    if name in _RUNNER_NAMES:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'dflash_batch' has no attribute {name!r}")


__all__ = [
    "Completion",
    "GenerationError",
    "GenerationStats",
    "Piece",
    *_ENGINE_NAMES,
    *_RUNNER_NAMES,
]
