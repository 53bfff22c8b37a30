"""Kernel sources kept as files beside their launcher (``.inc`` / ``.cuh`` / ``.metal``), read
once at import. ``mx.fast.cuda_kernel`` / ``metal_kernel`` take a body and a header, not files,
so these are fragments: a line ``#include "NAME"`` pastes the sibling file NAME in its place."""

from __future__ import annotations

import re
from pathlib import Path

INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def read(folder: Path, name: str) -> str:
    """The file ``folder / name`` with its ``#include "..."`` lines expanded."""
    text = (folder / name).read_text()
    return INCLUDE.sub(lambda found: read(folder, found.group(1)), text)


def compact(source: str) -> str:
    """Drop comments, indentation and runs of blanks: MLX rebuilds and hashes the source on
    every call."""
    lines = (" ".join(line.split("//")[0].split()) for line in source.splitlines())
    return "\n" + "\n".join(line for line in lines if line) + "\n"  # MLX pastes it between lines


__all__ = ["compact", "read"]
