"""Which backend the default device runs: the one answer every routed op and kernel asks."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

BACKENDS = ("cpu", "cuda", "metal")

_known: Dict[object, str] = {}  # per default device type: asked on every routed call


def backend() -> str:
    """The default device's backend: "cuda" or "metal" where it is a GPU, else "cpu"."""
    device = mx.default_device().type  # mx.Device objects hash by identity: key by type
    if device not in _known:
        _known[device] = _detect(device)
    return _known[device]


def gpu() -> Optional[str]:
    """The GPU backend, "cuda" or "metal"; None on the CPU."""
    found = backend()
    return None if found == "cpu" else found


def on_cpu() -> bool:
    return backend() == "cpu"


def _detect(device) -> str:
    if device != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # absent from some MLX builds
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


__all__ = ["BACKENDS", "backend", "gpu", "on_cpu"]
