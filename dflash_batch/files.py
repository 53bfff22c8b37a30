"""Atomic writes, the one way this package puts a file or folder in place: write under a hidden
temporary name in the same folder, fsync it, rename it over the target, fsync the folder. A crash
at any point leaves either the old content or the new, never a torn file. Plain Python: the
engine, the training code and the runner all use it."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Union

Data = Union[bytes, str]


def keyed_path(folder: Path, key: Dict[str, Any]) -> Path:
    """``<folder>/<hash of key>.json``: the file a JSON record kept under ``key`` lives in (the
    cost tables, the kernels' kept self-checks); the record holds its key, to tell a collision."""
    text = json.dumps(key, sort_keys=True)
    return folder / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse a dir fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_name(path: Path) -> Path:
    """A hidden, unique name next to ``path``: ``.<name>.<random>.tmp``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def commit_file(tmp: Path, path: Path) -> Path:
    """Put a fully written temp file in place: fsync it, rename it over ``path``, fsync the dir."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)
    return Path(path)


def write_atomic(path: Path, data: Data) -> Path:
    """Replace ``path``'s content with ``data`` (text is written as UTF-8)."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        return commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file_atomic(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` writes a whole file (say, a Parquet table); it then replaces ``path``."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        write(tmp)
        return commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, names in os.walk(folder):
        for name in names:
            with open(Path(root, name), "rb+") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def write_folder_atomic(out: Path, write: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Build a folder with ``write(tmp)`` and move it into place in one rename. If ``out``
    appears meanwhile (another process finished first) that one is kept, unless ``replace``:
    then the old ``out`` is removed first (a crash between the two leaves no ``out``, never a
    half-written one)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        _fsync_tree(tmp)
        if replace:
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
