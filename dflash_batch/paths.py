"""Where files live: the job home (job records, queue, results) and the model cache (converted
models, built CPU ops). Standard library only (and the environment's table), so the runner and the
engine's lowest floor can both ask it without importing anything above them."""

from __future__ import annotations

import sys
from pathlib import Path

from . import environment

HOME_ENV = "DFLASH_BATCH_HOME"
CACHE_ENV = "DFLASH_BATCH_CACHE"


def home_dir() -> Path:
    """``$DFLASH_BATCH_HOME``, else the user's data dir (XDG on Linux, Application Support on
    macOS)."""
    home = environment.get(HOME_ENV)
    if home:
        return home.resolve()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "dflash-batch"
    base = environment.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return base.resolve() / "dflash-batch"


def cache_dir() -> Path:
    """The model cache: ``$DFLASH_BATCH_CACHE``, else ``$XDG_CACHE_HOME/dflash-batch``
    (default ``~/.cache/dflash-batch``) on Linux, ``~/Library/Caches/dflash-batch`` on macOS."""
    cache = environment.get(CACHE_ENV)
    if cache:
        return cache
    if sys.platform == "darwin":
        return Path("~/Library/Caches/dflash-batch").expanduser()
    return (environment.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "dflash-batch"


def costs_dir() -> Path:
    """The measured pass costs kept per machine and model (engine/cost_tables.py): in the model cache."""
    return cache_dir() / "costs"


def kernel_checks_dir() -> Path:
    """The GPU kernels' passed self-checks kept per machine (engine/ops/kernels/selfcheck.py): in
    the model cache."""
    return cache_dir() / "kernel-checks"


__all__ = ["CACHE_ENV", "HOME_ENV", "cache_dir", "costs_dir", "home_dir", "kernel_checks_dir"]
