"""Who may write an output dir: ``fcntl.flock`` on ``<out_dir>/.lock``. The foreground ``run``
takes it exclusively; queue workers take it shared (each holds its own chunks' leases, see
lease.py), so several workers run one job's chunks at once while a foreground run excludes them.

The kernel drops a flock when its process dies (even by ``kill -9``), so a dead worker cannot
leave a job locked. The holder's pid and host are written into the file for messages. The file
is never opened through a symlink (the holder truncates it).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..checks import BadValue
from ..errors import Locked


class DirLock:
    def __init__(self, directory: os.PathLike, shared: bool = False, wait: float = 2.0):
        self.path = Path(directory) / ".lock"
        self.shared = shared
        self.wait = wait if shared else 0.0  # shared holders ride out a `status` probe's instant
        self._fd: Optional[int] = None

    def acquire(self) -> "DirLock":
        """Take the lock or raise ``Locked`` (exclusive: at once; shared: after ``wait`` s)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if self.path.is_symlink():
                raise BadValue(f"{self.path} is a symlink; refusing to open it (remove it)") from e
            raise
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise Locked(f"{self.path.parent} is in use by {holder}") from None
        note = "queue workers, such as " if self.shared else ""
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{note}pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(directory: os.PathLike) -> bool:
    """Whether a live process holds the dir's lock right now (shared or exclusive)."""
    path = Path(directory) / ".lock"
    if not path.exists() or path.is_symlink():
        return False
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False
