"""Chunk leases and worker records, kept in the queue's own key-value store (Huey's result store:
``put_if_empty`` / ``put_data`` / ``peek_data``, the same on SQLite and Redis).

A lease says "worker W holds chunk C of output dir D until time T". A worker takes a chunk only
with its lease, renews it from a heartbeat thread every ``ttl / 6`` seconds, and writes a row only
while the lease it last renewed has more than ``guard`` seconds left (a local clock check, no
round trip). A worker that dies, or hangs (SIGSTOP, a stalled machine), stops renewing; once the
lease has expired, one other worker takes it over (the takeover is claimed with ``put_if_empty``
on a key named after the expired lease's token, so exactly one claimant wins), commits the dead
holder's journal and generates the rest. A hung holder that wakes finds its lease past its guard
and writes nothing more. So the time after which a dead worker's chunk comes back is ``ttl``
plus the reaper's period, and an item is written twice only if a holder stalls for more than
``guard`` seconds between its check and the write that follows it (one row, or one part).

Lease times are wall-clock seconds (``time.time()``): machines sharing a queue need clocks in
step (NTP) to well within ``guard``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import orjson

from .. import environment
from ..errors import LeaseLost

log = logging.getLogger("dflash_batch.worker")
LEASE_ENV = "DFLASH_BATCH_LEASE_S"
PREFIX = "dflash-batch:"
WORKER_PREFIX = PREFIX + "worker:"
LEASE_PREFIX = PREFIX + "lease:"


def lease_ttl() -> float:
    """Seconds a lease lasts without renewal: ``$DFLASH_BATCH_LEASE_S``, else its default in
    the table (dflash_batch/environment.py)."""
    return environment.get(LEASE_ENV)


def scope_of(output_dir: os.PathLike) -> str:
    """A short stable name for an output dir: leases are per (output dir, chunk), so two jobs that
    share a dir (a resubmitted input) never run the same chunk at once."""
    return hashlib.sha1(os.fsencode(os.path.abspath(output_dir))).hexdigest()[:16]


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


@dataclass
class Lease:
    key: str
    token: str
    record: Dict[str, Any]
    expires: float  # as last written to the store
    guard: float
    clock: Callable[[], float] = field(default=time.time, repr=False)
    lost: bool = False

    def valid(self) -> bool:
        """May the holder still write? Only while the lease has more than ``guard`` seconds left."""
        return not self.lost and self.clock() < self.expires - self.guard


class Leases:
    """Leases and worker records in a Huey storage (``huey.storage``)."""

    def __init__(
        self, storage, ttl: Optional[float] = None, clock: Callable[[], float] = time.time
    ):
        self.storage = storage
        self.ttl = lease_ttl() if ttl is None else ttl
        self.guard = self.ttl / 3  # the holder stops writing this long before the lease expires
        self.clock = clock

    # -- raw records ---------------------------------------------------------------------------
    def _get(self, key: str) -> Optional[Dict[str, Any]]:
        from huey.constants import EmptyData

        value = self.storage.peek_data(key)
        if value is EmptyData or value is None:
            return None
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return None

    def _records(self, prefix: str) -> List[Dict[str, Any]]:
        out = []
        for key, value in self.storage.result_items().items():
            key = key.decode() if isinstance(key, bytes) else key
            if key.startswith(prefix) and ":takeover:" not in key:
                try:
                    out.append(orjson.loads(value))
                except orjson.JSONDecodeError:
                    continue
        return out

    # -- leases --------------------------------------------------------------------------------
    @staticmethod
    def key(scope: str, chunk: int) -> str:
        return f"{LEASE_PREFIX}{scope}:{chunk:05d}"

    def holder(self, scope: str, chunk: int) -> Optional[Dict[str, Any]]:
        """The live lease on a chunk, or None (free or expired)."""
        rec = self._get(self.key(scope, chunk))
        return rec if rec is not None and rec["expires"] > self.clock() else None

    def acquire(self, scope: str, chunk: int, **info) -> Optional[Lease]:
        """Take the chunk's lease, or take over an expired one; None while another holds it."""
        key = self.key(scope, chunk)
        token = secrets.token_hex(8)
        now = self.clock()
        record = dict(info, token=token, chunk=chunk, since=now, expires=now + self.ttl)
        if self.storage.put_if_empty(key, orjson.dumps(record)):
            return Lease(key, token, record, record["expires"], self.guard, self.clock)
        current = self._get(key)
        if current is None:  # released between our two reads: try once more next time
            return None
        if current["expires"] > now:
            return None
        # Expired: exactly one claimant wins the takeover of this token.
        if not self.storage.put_if_empty(f"{key}:takeover:{current['token']}", token.encode()):
            return None
        again = self._get(key)
        if again is None or again["token"] != current["token"]:  # someone else moved on meanwhile
            return None
        record["replaced"] = current["token"]
        self.storage.put_data(key, orjson.dumps(record))
        return Lease(key, token, record, record["expires"], self.guard, self.clock)

    def renew(self, lease: Lease) -> bool:
        """Extend a lease still held (and not past its guard); mark it lost otherwise."""
        if not lease.valid():
            lease.lost = True
            return False
        current = self._get(lease.key)
        if current is None or current["token"] != lease.token:
            lease.lost = True
            return False
        expires = self.clock() + self.ttl
        lease.record = dict(current, expires=expires)
        self.storage.put_data(lease.key, orjson.dumps(lease.record))
        lease.expires = expires
        return True

    def release(self, lease: Lease) -> None:
        """Give the chunk back (only if still ours), and drop the takeover claim it came with."""
        current = self._get(lease.key)
        if current is not None and current["token"] == lease.token:
            self.storage.delete_data(lease.key)
            if "replaced" in current:
                self.storage.delete_data(f"{lease.key}:takeover:{current['replaced']}")
        lease.lost = True

    def leases(self) -> List[Dict[str, Any]]:
        """Every live lease record (for ``status``)."""
        now = self.clock()
        return [r for r in self._records(LEASE_PREFIX) if r.get("expires", 0) > now]

    # -- worker records ------------------------------------------------------------------------
    def put_worker(self, worker_id: str, **info) -> None:
        self.storage.put_data(
            WORKER_PREFIX + worker_id, orjson.dumps(dict(info, id=worker_id, seen=self.clock()))
        )

    def drop_worker(self, worker_id: str) -> None:
        self.storage.delete_data(WORKER_PREFIX + worker_id)

    def workers(self, within: Optional[float] = None) -> List[Dict[str, Any]]:
        """Worker records seen within ``within`` seconds (default 3 lease lengths), by id."""
        horizon = self.clock() - (3 * self.ttl if within is None else within)
        return sorted(
            (w for w in self._records(WORKER_PREFIX) if w.get("seen", 0) >= horizon),
            key=lambda w: w["id"],
        )


class Rate:
    """Rows and completion tokens per second over the last ``window`` seconds."""

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.time):
        self.window = window
        self.clock = clock
        self.events: List[tuple] = []  # (time, completion tokens)
        self.rows = 0
        self._lock = threading.Lock()  # rows are added by the worker thread, read by the heartbeat

    def add(self, tokens: int) -> None:
        with self._lock:
            self.events.append((self.clock(), tokens))
            self.rows += 1

    def rates(self) -> Dict[str, float]:
        now = self.clock()
        with self._lock:
            self.events = [e for e in self.events if e[0] > now - self.window]
            events = list(self.events)
        if not events:
            return {"rows": self.rows, "rows_per_s": 0.0, "tokens_per_s": 0.0}
        span = max(now - events[0][0], 1.0)  # at least a second: one row is not infinitely fast
        return {
            "rows": self.rows,
            "rows_per_s": len(events) / span,
            "tokens_per_s": sum(t for _, t in events) / span,
        }


class Heartbeat(threading.Thread):
    """A worker's heartbeat: renews its leases (``current()``) every ttl / 6 s, writes its record
    (``record()``), and every ttl / 2 s (at least 2 s) calls ``reap()`` to requeue chunks nobody
    holds. Queue errors (Redis restarting) are logged and retried: a lease lapses by itself if
    they last."""

    def __init__(self, leases: Leases, worker_id: str, current: Callable[[], List[Lease]],
                 record: Callable[[], Dict[str, Any]], reap: Callable[[], int]):  # fmt: skip
        super().__init__(name="heartbeat", daemon=True)
        self.leases, self.worker_id = leases, worker_id
        self.current, self.record, self.reap = current, record, reap
        self.done = threading.Event()

    def run(self) -> None:
        beat, reap_every = self.leases.ttl / 6, max(self.leases.ttl / 2, 2.0)
        next_reap = time.monotonic() + reap_every
        while not self.done.wait(beat):
            try:
                for lease in self.current():
                    if not lease.lost and not self.leases.renew(lease):
                        log.warning(
                            "lease on chunk %d of %s lost",
                            lease.record["chunk"],
                            lease.record["job"],
                        )
                self.leases.put_worker(self.worker_id, **self.record())
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + reap_every
                    n = self.reap()
                    if n:
                        log.info(
                            "requeued %d unfinished chunk(s) with no task waiting and no live lease",
                            n,
                        )
            except Exception as e:  # the queue is down for a moment: try again next beat
                log.warning("heartbeat: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        self.done.set()
        try:
            self.leases.drop_worker(self.worker_id)
        except Exception as e:
            log.warning("could not remove the worker record: %s", e)
