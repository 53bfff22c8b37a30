"""The GPU kernels' sources are files beside their launchers (read once at import, shipped as
package data), not C held in Python strings."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

from dflash_batch.engine.ops.kernels import attention as ka
from dflash_batch.engine.ops.kernels import gated_delta as gd
from dflash_batch.engine.ops.kernels import matmul as km
from dflash_batch.engine.ops.kernels import sources

import pytest

from tests.runner_fixtures import REPO

PACKAGE = REPO / "dflash_batch"
KERNELS = Path(ka.__file__).parent
SUFFIXES = (".cpp", ".cuh", ".metal", ".inc")


def kernel_files():
    return sorted(p for p in KERNELS.rglob("*") if p.suffix in SUFFIXES)


def test_every_kernel_source_file_ships_as_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]
    files = kernel_files()
    assert len(files) >= 15
    for path in files:
        name = path.relative_to(PACKAGE).as_posix()
        assert any(fnmatch.fnmatch(name, p) for p in patterns["dflash_batch"]), name


def test_includes_are_expanded_and_a_missing_one_is_an_error(tmp_path):
    for text in (
        ka.PASS1_BODY,
        ka.PASS1_MMA_BODY,
        ka.CUDA_PASS1,
        ka.CUDA_MMA,
        ka.METAL_PASS1,
        *gd._SOURCES.values(),
        km.BODY,
    ):
        assert '#include "' not in text
    assert "const int q_pos0 = Lk - Lq;" in ka.PASS1_BODY and "q_pos0 = Lk - Lq;" in ka.CUDA_MMA
    (tmp_path / "outer.inc").write_text('a\n#include "inner.inc"\nc\n')
    (tmp_path / "inner.inc").write_text("b\n")
    assert sources.read(tmp_path, "outer.inc") == "a\nb\n\nc\n"
    (tmp_path / "broken.inc").write_text('#include "absent.inc"\n')
    try:
        sources.read(tmp_path, "broken.inc")
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("a missing include must fail at import, not compile to nothing")


def test_no_kernel_source_is_held_in_a_python_string():
    """A string constant in the kernels' Python that reads as C (braces and semicolons over
    several lines) belongs in a source file."""
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                reads_as_c = text.count("\n") > 3 and text.count(";") > 3 and "{" in text
                assert not reads_as_c, (path, node.lineno)


def test_the_fused_cuda_core_reduction_is_gone():
    """It gave wrong logits on the GPU; the tensor-core kernel keeps its own fused tail."""
    assert not hasattr(ka, "FUSE_REDUCTION")
    assert "DFLASH_FUSED" not in ka.CUDA_PASS1 + ka.METAL_PASS1
    assert "ATOMIC_ADD(counters" in ka.CUDA_MMA
    assert set(ka.KERNELS) == {
        ("cuda", "mma"),
        ("cuda", "pass1"),
        ("cuda", "pass2"),
        ("metal", "pass1"),
        ("metal", "pass2"),
    }
