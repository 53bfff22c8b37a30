"""The engine's environment variables, checked together: a bad value is refused before a job
starts (``SettingError``, naming the variable) rather than failing the job when first read."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import SettingError
from ..paths import CACHE_ENV
from . import memory, tree  # noqa: F401
from .ops import attention, compiled, matmul, modes  # noqa: F401
from .ops.kernels import cpu, selfcheck  # noqa: F401


def check() -> None:
    """Raise ``SettingError`` for the first engine variable whose value cannot be used."""
    for switch in modes.Switch.made:
        switch.default()
    selfcheck.enabled()
    if os.environ.get(memory.ENV_LIMIT):
        memory.limit_bytes(os.environ[memory.ENV_LIMIT])
    cache = os.environ.get(CACHE_ENV)
    if cache and Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
        raise SettingError(f"{CACHE_ENV}={cache!r}: not a folder")
