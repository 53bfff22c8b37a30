"""Checks that make several workers on one job safe, refusing setups where they cannot be.

- A SQLite queue must be on a local file system: SQLite's locking is unsafe over NFS/SMB.
- Output dirs need working ``flock`` (the foreground ``run`` excludes workers with it).
- A Redis queue serves exactly one home: the home (job records) must be the same shared folder on
  every machine. The first command on a Redis db writes ``<home>/.shared-home.json`` (an id) and
  the same id into Redis; a machine whose home lacks that file (the shared folder is not mounted
  there), or holds another id (a second home on one Redis db), is refused.

Nothing here imports MLX or the engine.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Optional

import orjson

from ..errors import SetupError
from ..files import write_atomic
from .jobs import list_jobs
from .spec import JobSpec

HOME_MANIFEST = ".shared-home.json"
HOME_KEY = "dflash-batch:home"
# Network file systems, on which SQLite's own locks are unreliable (the SQLite FAQ).
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ceph", "glusterfs", "lustre", "gpfs",
              "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "fuse.s3fs", "fuse.rclone", "fuse.gcsfuse", "davfs"}  # fmt: skip


def fs_type(path: os.PathLike, mountinfo: Optional[str] = None) -> Optional[str]:
    """The file system type of the mount holding ``path`` (Linux ``/proc/self/mountinfo``; None
    where it cannot be read). The longest mount point that prefixes the path wins."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, kind = "", None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, right.split()[0]
    return kind


def check_sqlite_home(home: os.PathLike, mountinfo: Optional[str] = None) -> None:
    """Refuse a SQLite queue in a home on a network file system."""
    kind = fs_type(home, mountinfo)
    if (
        kind in NETWORK_FS
    ):  # (not every FUSE file system: fuse-overlayfs of rootless containers is local)
        raise SetupError(
            f"the queue {Path(home) / 'queue.db'} would be SQLite on a network file system ({kind}), where "
            f"its locking is unsafe: put the home on a local disk (--home; home= in Python), "
            f"or the queue on Redis (--redis URL; redis_url=) for workers on several machines"
        )


def check_flock(directory: os.PathLike) -> None:
    """Refuse an output dir whose file system has no working ``flock`` (an NFS mount without lock
    support answers ENOLCK): the foreground run could not exclude workers there."""
    directory = Path(directory)
    while (
        not directory.is_dir() and directory.parent != directory
    ):  # probe where it will be, creating nothing
        directory = directory.parent
    probe = directory / f".flock-probe-{secrets.token_hex(3)}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise SetupError(f"{directory}: cannot create files there ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise SetupError(
                f"{directory}: its file system has no working flock ({e.strerror}); output dirs of jobs run "
                f"by several workers need it (NFS: mount with lock support, not `nolock`)"
            ) from None
        raise
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def check_output_dir(spec: JobSpec, home: os.PathLike) -> None:
    """Before a job is queued: its output dir needs flock, and every unfinished job on it the same
    chunk size (leases are per (output dir, chunk index): chunks of two sizes would overlap)."""
    out = spec.resolved_output_dir(Path(home))
    check_flock(out)
    for other in list_jobs(Path(home)):
        if other.output_dir != out or other.spec.chunk_size == spec.chunk_size:
            continue
        if other.pending_chunks() and not other.cancelled() and not other.failure():
            raise SetupError(
                f"chunk_size: job {other.id} writes {out} in chunks of {other.spec.chunk_size} rows and is not "
                f"finished; a job on the same output dir must use the same chunk_size (or wait for it)"
            )


def claim_home(storage, home: os.PathLike) -> str:
    """Bind a Redis queue to one home (returns its id); refuse a second home, or a machine where
    the shared home is not mounted. ``storage`` is the queue's Huey storage."""
    from huey.constants import EmptyData

    home = Path(home)
    manifest = home / HOME_MANIFEST
    mine = _read_id(manifest)
    stored = storage.peek_data(HOME_KEY)
    if stored is EmptyData and mine is None:
        mine = secrets.token_hex(8)
        record = {"id": mine, "path": str(home), "host": socket.gethostname(), "at": time.time()}
        if storage.put_if_empty(HOME_KEY, orjson.dumps(record)):
            write_atomic(manifest, orjson.dumps(record))
            return mine
        stored = storage.peek_data(HOME_KEY)  # another machine bound it first
        mine = None
    if (
        stored is EmptyData
    ):  # our manifest, and a queue that lost its record (a Redis without persistence)
        storage.put_if_empty(HOME_KEY, manifest.read_bytes())
        return mine
    theirs = orjson.loads(stored)
    if (
        mine is None
    ):  # the process that bound the queue writes the manifest just after: give it a moment
        mine = _await_manifest(manifest)
    if mine is None:
        raise SetupError(
            f"this Redis queue serves the home {theirs['path']} (first used from {theirs['host']}), but "
            f"{manifest} does not exist: mount that shared folder here and point --home (home=) "
            f"at it, or use another Redis database for another home"
        )
    if mine != theirs["id"]:
        raise SetupError(
            f"this Redis queue serves another home ({theirs['path']} on {theirs['host']}); {home} is a second "
            f"home: workers would drop its jobs as unknown. Use one shared home, or another Redis database "
            f"(redis://host:6379/<n>)"
        )
    return mine


def _await_manifest(manifest: Path, tries: int = 20, pause: float = 0.1) -> Optional[str]:
    """The manifest's id once it appears, within ``tries`` looks; None if it never does."""
    for _ in range(tries):
        time.sleep(pause)
        found = _read_id(manifest)
        if found is not None:
            return found
    return None


def _read_id(manifest: Path) -> Optional[str]:
    try:
        return orjson.loads(manifest.read_bytes())["id"]
    except FileNotFoundError:
        return None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise SetupError(
            f"{manifest} is not a shared-home manifest (delete it to bind this home again)"
        ) from None


def device_env(device: int) -> dict:
    """Environment that pins this process to one GPU, set before the backend loads: MLX's CUDA
    backend honours ``CUDA_VISIBLE_DEVICES`` (the one device shows as device 0)."""
    if device < 0:
        raise SetupError(f"--device must be a GPU index >= 0, got {device}")
    return {"CUDA_VISIBLE_DEVICES": str(device)}
