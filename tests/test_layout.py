"""Layout rules of the package, checked on its source: one errors module with a common base,
one atomic-write helper, no test-only code in the package. Plain Python, no MLX."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from dflash_batch import errors, files

PACKAGE = Path(errors.__file__).resolve().parent
BUILTIN_ERRORS = {
    "Exception",
    "ValueError",
    "RuntimeError",
    "LookupError",
    "KeyError",
    "TypeError",
    "OSError",
}


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_every_exception_class_is_in_errors_under_one_base():
    outside = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if (
                    bases & BUILTIN_ERRORS or any(b.endswith("Error") for b in bases)
                ) and path.name != "errors.py":
                    outside.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert outside == [], outside
    defined = [
        v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)
    ]
    assert len(defined) >= 15 and all(issubclass(e, errors.DflashBatchError) for e in defined)
    # the old homes still export them, and the built-in bases callers catch are kept
    from dflash_batch.runner.items import InputError
    from dflash_batch.runner.spec import SpecError

    assert InputError is errors.InputError and issubclass(SpecError, ValueError)
    assert issubclass(errors.Locked, RuntimeError) and issubclass(errors.JobNotFound, LookupError)


def test_files_are_put_in_place_only_through_files_py():
    """No os.replace / os.rename / Path.rename / Path.replace(path) outside files.py."""
    found = []
    for path, tree in sources():
        if path.name == "files.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                if name in ("replace", "rename") and (
                    (isinstance(owner, ast.Name) and owner.id == "os")
                    or (name == "rename" or _looks_like_path_replace(node))
                ):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
    assert found == [], found


def _looks_like_path_replace(call: ast.Call) -> bool:
    """``tmp.replace(path)``: one positional argument that is not a string (str.replace takes two)."""
    return len(call.args) == 1 and not call.keywords and not isinstance(call.args[0], ast.Constant)


def test_write_atomic_fsyncs_and_leaves_nothing_behind(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    target = tmp_path / "state"
    files.write_atomic(target, "one")
    assert target.read_text() == "one" and len(synced) >= 2  # the file and its folder
    files.write_atomic(target, b"two")
    assert target.read_bytes() == b"two"

    def torn(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        files.write_file_atomic(target, torn)
    assert target.read_bytes() == b"two" and sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_write_folder_atomic_replaces_or_keeps(tmp_path):
    out = tmp_path / "model"
    files.write_folder_atomic(out, lambda d: (d / "a").write_text("1"))
    files.write_folder_atomic(out, lambda d: (d / "a").write_text("2"))  # a finished one is kept
    assert (out / "a").read_text() == "1"
    files.write_folder_atomic(out, lambda d: (d / "b").write_text("3"), replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["b"] and [
        p.name for p in tmp_path.iterdir()
    ] == ["model"]


def test_no_test_helpers_in_the_package():
    assert not (PACKAGE / "engine" / "synthetic.py").exists()
    assert (Path(__file__).parent / "synthetic.py").exists()
