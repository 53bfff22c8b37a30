"""Where files live: the job home (job records, queue, results) and the model cache (converted
models, built CPU ops). Standard library only, so the runner and the engine's lowest floor can
both ask it without importing anything above them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HOME_ENV = "DFLASH_BATCH_HOME"
CACHE_ENV = "DFLASH_BATCH_CACHE"


def home_dir() -> Path:
    """``$DFLASH_BATCH_HOME``, else the user's data dir (XDG on Linux, Application Support on
    macOS)."""
    env = os.environ.get(HOME_ENV)
    if env:
        return Path(env).expanduser().resolve()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "dflash-batch"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser().resolve() / "dflash-batch"


def cache_dir() -> Path:
    """The model cache: ``$DFLASH_BATCH_CACHE``, else ``$XDG_CACHE_HOME/dflash-batch``
    (default ``~/.cache/dflash-batch``) on Linux, ``~/Library/Caches/dflash-batch`` on macOS."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if sys.platform == "darwin":
        return Path("~/Library/Caches/dflash-batch").expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "dflash-batch"


def costs_dir() -> Path:
    """The measured pass costs kept per machine and model (engine/cost_tables.py): in the model cache."""
    return cache_dir() / "costs"


__all__ = ["CACHE_ENV", "HOME_ENV", "cache_dir", "costs_dir", "home_dir"]
