"""The MLX engine: the only part of dflash_batch that imports MLX."""

from .backend import preload_blas

preload_blas()  # before mlx.core is imported anywhere below

from .engine import Engine, load_engine  # noqa: E402
from .loading import load_drafter, load_target, resolve_model_path  # noqa: E402

__all__ = ["Engine", "load_engine", "load_drafter", "load_target", "resolve_model_path", "preload_blas"]
