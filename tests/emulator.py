"""Building the C++ programs that run a GPU kernel's body on the CPU (tests/test_attention.py,
tests/test_matmul.py): a missing compiler, or one without C++20's <barrier>, skips the test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Sequence

import pytest


def compiler() -> str:
    """The C++ compiler on the PATH; skips the calling test when there is none."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the kernel emulator")
    return cxx


def build(source: str, folder: Path, name: str, flags: Sequence[str] = ()) -> Path:
    """Compile ``source`` into ``folder / name`` (threads, C++20, and ``flags``) and return the executable."""
    cxx = compiler()
    (folder / f"{name}.cpp").write_text(source)
    exe = folder / name
    done = subprocess.run(
        [cxx, "-std=c++20", "-O1", *flags, "-pthread", "-o", str(exe), str(folder / f"{name}.cpp")],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 and "barrier" in done.stderr and "No such file" in done.stderr:
        pytest.skip("C++ compiler lacks <barrier>")
    assert done.returncode == 0, done.stderr[-4000:]
    return exe
