"""Training DFlash drafters by self-distillation (MLX: Apple silicon, CUDA and CPU)."""

from .. import engine as _engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from .trainer import TrainConfig, Trainer  # noqa: E402

__all__ = ["TrainConfig", "Trainer"]
