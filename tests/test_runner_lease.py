"""Chunk leases and the scale-out checks, on Huey's own storages (SQLite file, Redis where a
redis-server is installed), with a controlled clock."""

from __future__ import annotations

import errno
import fcntl
import threading

import pytest

from dflash_batch.runner import scaleout
from dflash_batch.runner.lease import Lease, Leases, Rate, lease_ttl, scope_of


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture
def sqlite_storage(tmp_path):
    from huey import SqliteHuey

    return SqliteHuey(name="dflash-batch", filename=str(tmp_path / "q.db"), results=False).storage


def test_one_holder_renewal_and_release(sqlite_storage):
    clock = Clock()
    leases = Leases(sqlite_storage, ttl=30, clock=clock)
    a = leases.acquire("dir", 3, worker="a")
    assert isinstance(a, Lease) and a.valid()
    assert leases.acquire("dir", 3, worker="b") is None  # held
    assert leases.acquire("dir", 4, worker="b") is not None  # another chunk is free
    assert leases.holder("dir", 3)["worker"] == "a"
    clock.t += 15
    assert leases.renew(a) and a.expires == clock.t + 30
    clock.t += 25
    assert leases.acquire("dir", 3, worker="b") is None  # renewed: still a's
    leases.release(a)
    assert not a.valid() and leases.holder("dir", 3) is None
    assert leases.acquire("dir", 3, worker="b") is not None


def test_expired_lease_is_taken_over_once_and_the_old_holder_may_not_write(sqlite_storage):
    clock = Clock()
    leases = Leases(sqlite_storage, ttl=30, clock=clock)
    a = leases.acquire("dir", 0, worker="a")
    clock.t += (
        21  # within ttl but past the guard (ttl / 3): a stops writing before anyone may take over
    )
    assert not a.valid()
    assert leases.acquire("dir", 0, worker="b") is None  # not expired yet
    clock.t += 10  # expired
    b = leases.acquire("dir", 0, worker="b")
    assert b is not None and b.record["replaced"] == a.token
    assert leases.acquire("dir", 0, worker="c") is None  # b holds it now
    assert not leases.renew(a) and a.lost  # a wakes up: its lease is gone
    leases.release(a)  # a release by a lost holder leaves b's lease alone
    assert leases.holder("dir", 0)["worker"] == "b"
    leases.release(b)
    assert (
        leases.holder("dir", 0) is None and sqlite_storage.result_store_size() == 0
    )  # takeover claim dropped


class PeekTogether:
    """A storage whose second read in a thread (the re-check of an expired lease before the
    takeover is written) waits until every claimant has got that far: the worst interleaving."""

    def __init__(self, storage, barrier: threading.Barrier):
        self.storage, self.barrier, self.peeks = storage, barrier, 0

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def peek_data(self, key):
        value = self.storage.peek_data(key)
        self.peeks += 1
        if self.peeks == 2:
            try:
                self.barrier.wait()
            except threading.BrokenBarrierError:  # fewer claimants got this far: fine
                pass
        return value


def test_concurrent_takeover_has_one_winner(sqlite_storage, tmp_path):
    from huey import SqliteHuey

    clock = Clock()
    Leases(sqlite_storage, ttl=5, clock=clock).acquire("dir", 0, worker="dead")
    clock.t += 10
    barrier = threading.Barrier(8, timeout=1.0)
    won = []

    def claim(i):  # each thread its own connection, as separate workers have
        storage = SqliteHuey(
            name="dflash-batch", filename=str(tmp_path / "q.db"), results=False
        ).storage
        if Leases(PeekTogether(storage, barrier), ttl=5, clock=clock).acquire(
            "dir", 0, worker=f"w{i}"
        ):
            won.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(won) == 1, won


def test_worker_records_and_rates(sqlite_storage):
    clock = Clock()
    leases = Leases(sqlite_storage, ttl=10, clock=clock)
    leases.put_worker("h-1", host="h", device=0, rows_per_s=2.0)
    leases.acquire("dir", 1, worker="h-1", job="j", output_dir="/out")
    assert [w["id"] for w in leases.workers()] == ["h-1"]
    assert [(r["worker"], r["chunk"]) for r in leases.leases()] == [("h-1", 1)]
    clock.t += 31
    assert leases.workers() == [] and leases.leases() == []  # stale records are not shown
    rate = Rate(window=60, clock=clock)
    for _ in range(10):
        rate.add(8)
        clock.t += 0.5
    r = rate.rates()
    assert (
        r["rows"] == 10
        and r["rows_per_s"] == pytest.approx(10 / 5)
        and r["tokens_per_s"] == pytest.approx(80 / 5)
    )


def test_lease_ttl_from_the_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_BATCH_LEASE_S", "4")
    assert lease_ttl() == 4
    for bad in ("nan", "0", "x", "1e9"):
        monkeypatch.setenv("DFLASH_BATCH_LEASE_S", bad)
        with pytest.raises(ValueError, match="DFLASH_BATCH_LEASE_S"):
            lease_ttl()
    assert scope_of("/a/b") == scope_of("/a/b/") != scope_of("/a/c")


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /mnt/shared rw,relatime shared:20 - nfs4 server:/export rw,vers=4.2
41 40 0:51 / /mnt/shared/local rw - tmpfs tmpfs rw
"""


def test_sqlite_queue_on_a_network_file_system_is_refused():
    assert scaleout.fs_type("/mnt/shared/home", MOUNTINFO) == "nfs4"
    assert scaleout.fs_type("/mnt/shared/local/x", MOUNTINFO) == "tmpfs"
    assert scaleout.fs_type("/mnt/sharedx", MOUNTINFO) == "ext4"
    with pytest.raises(scaleout.SetupError, match=r"SQLite on a network file system \(nfs4\)"):
        scaleout.check_sqlite_home("/mnt/shared/home", MOUNTINFO)
    scaleout.check_sqlite_home("/home/me", MOUNTINFO)  # local: fine
    scaleout.check_sqlite_home("/mnt/shared/local", MOUNTINFO)


def test_an_output_dir_without_flock_is_refused(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    scaleout.check_flock(tmp_path / "out")  # a local dir: fine
    assert not [p for p in (tmp_path / "out").iterdir()]  # the probe is removed
    scaleout.check_flock(tmp_path / "not-yet" / "out")  # probed in the nearest folder that exists
    assert not (tmp_path / "not-yet").exists()

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(scaleout.SetupError, match="no working flock"):
        scaleout.check_flock(tmp_path / "out")


def test_one_home_per_redis_queue(sqlite_storage, tmp_path):
    # The same rule on any Huey storage: the first home binds the queue.
    first, second, mounted = tmp_path / "home", tmp_path / "other-home", tmp_path / "machine-2"
    for d in (first, second, mounted):
        d.mkdir()
    ident = scaleout.claim_home(sqlite_storage, first)
    assert scaleout.claim_home(sqlite_storage, first) == ident  # again: fine
    with pytest.raises(scaleout.SetupError, match="does not exist: mount that shared folder"):
        scaleout.claim_home(
            sqlite_storage, second
        )  # a home without the manifest: not the shared one
    (second / scaleout.HOME_MANIFEST).write_bytes(b'{"id": "0123", "path": "x", "host": "y"}')
    with pytest.raises(scaleout.SetupError, match="is a second home"):
        scaleout.claim_home(sqlite_storage, second)
    # the shared folder seen from another machine: the manifest is there, so it is accepted
    (mounted / scaleout.HOME_MANIFEST).write_bytes((first / scaleout.HOME_MANIFEST).read_bytes())
    assert scaleout.claim_home(sqlite_storage, mounted) == ident
    # a queue that lost its record (Redis without persistence) is bound again by the manifest's home
    sqlite_storage.flush_results()
    assert scaleout.claim_home(sqlite_storage, first) == ident


def test_device_env():
    assert scaleout.device_env(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    with pytest.raises(scaleout.SetupError, match="--device"):
        scaleout.device_env(-1)
