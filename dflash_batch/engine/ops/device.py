"""Which backend the default device runs: the one answer every routed op and kernel asks."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

BACKENDS = ("cpu", "cuda", "metal")

# What MLX's ``device_info`` says of one card or one moment, not of the hardware: CUDA reports the
# device's free memory (another process's allocations change it) and the card's own UUID and bus.
NOT_HARDWARE = ("free_memory", "uuid", "pci_bus_id")

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


def hardware() -> Dict[str, object]:
    """The default device as MLX describes it (name, architecture, memory size), less what
    describes one card or one moment (``NOT_HARDWARE``): two cards of one model match."""
    return {
        k: v
        for k, v in mx.device_info().items()
        if isinstance(v, (str, int, float)) and k not in NOT_HARDWARE
    }


def _detect(device) -> str:
    if device != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # absent from some MLX builds
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


__all__ = ["BACKENDS", "NOT_HARDWARE", "backend", "gpu", "hardware", "on_cpu"]
