"""Backend set-up that must happen before ``mlx.core`` is imported: a fast BLAS on Linux CPU, and
MLX's CUDA kernel cache kept in the model cache.

The ``mlx[cpu]`` wheel links a reference BLAS, an order of magnitude and more slower at fp32 GEMM
than an optimised one (README, "Linux CPU"). Loading an optimised CBLAS with RTLD_GLOBAL first
makes MLX's ``cblas_sgemm`` resolve to it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings
from typing import Optional

from ... import environment

BLAS_ENV = "DFLASH_BATCH_BLAS"  # a path to a CBLAS .so, or "none" to keep MLX's bundled one
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/opt/homebrew/opt/openblas/lib/libopenblas.dylib",
)

_loaded: Optional[str] = None


def _find_blas() -> Optional[str]:
    choice = environment.get(BLAS_ENV)
    if choice:
        return None if choice.lower() == "none" else choice
    for path in _CANDIDATES:
        if os.path.exists(path):
            return path
    mkl = glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*"))
    return mkl[0] if mkl else None


def preload_blas() -> Optional[str]:
    """Load an optimised CBLAS for MLX's CPU backend on Linux. Returns its path, or None."""
    global _loaded
    if _loaded or not sys.platform.startswith("linux"):
        return _loaded
    path = _find_blas()
    if path is None:
        return None
    if "mlx.core" in sys.modules:
        warnings.warn(
            f"mlx.core was imported before dflash_batch.engine; {path} was not preloaded and CPU "
            "matmuls use MLX's slow bundled BLAS. Import dflash_batch.engine first, or set LD_PRELOAD.",
            stacklevel=3,
        )
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        warnings.warn(f"could not load BLAS {path}: {e}", stacklevel=3)
        return None
    _loaded = path
    return path


def loaded_blas() -> Optional[str]:
    return _loaded


PTX_ENV = "MLX_PTX_CACHE_DIR"  # MLX's own: where its CUDA backend keeps the kernels it compiles


def keep_compiled_kernels() -> None:
    """Point MLX's CUDA kernel cache at the model cache (``<cache>/mlx-kernels/<MLX version>``)
    unless it is set: MLX's default lies under the temp folder, which a new machine or container
    starts empty, so every fresh process compiled its kernels again. A value already set is kept."""
    if environment.get(PTX_ENV):
        return
    from importlib import metadata

    from ...paths import cache_dir

    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    environment.export(MLX_PTX_CACHE_DIR=str(cache_dir() / "mlx-kernels" / version))
