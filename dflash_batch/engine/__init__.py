"""MLX inference (training/ is the other MLX user), on three floors: the decoding loop here, the
models in models/, how a pass computes in ops/. No floor imports one above it."""

from .ops.blas import keep_compiled_kernels, preload_blas

preload_blas()  # before mlx.core is imported anywhere below
keep_compiled_kernels()  # before MLX's CUDA backend first compiles a kernel

from .engine import Engine, load_engine, pick_dtype  # noqa: E402
from .models.loading import load_drafter, load_target, resolve_model_path  # noqa: E402
from .ops.switch import stock_ops  # noqa: E402  (mlx-lm's own ops on a model an engine routes)

__all__ = [
    "Engine",
    "load_engine",
    "pick_dtype",
    "load_drafter",
    "load_target",
    "resolve_model_path",
    "preload_blas",
    "stock_ops",
]
