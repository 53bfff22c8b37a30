"""The engine's environment variables, checked together: a bad value is refused before a job
starts (``SettingError``, naming the variable) rather than failing the job when first read."""

from __future__ import annotations

import os

from . import attention, compiled, matmul, memory, modes, tree  # noqa: F401  (their switches)
from .kernels import cpu, selfcheck  # noqa: F401


def check() -> None:
    """Raise ``SettingError`` for the first engine variable whose value cannot be used."""
    for switch in modes.Switch.made:
        switch.default()
    selfcheck.enabled()
    if os.environ.get(memory.ENV_LIMIT):
        memory.limit_bytes(os.environ[memory.ENV_LIMIT])
