"""The producer side of the Huey queue: where chunk tasks are put and found.

A task carries only ``(job_id, chunk)``; everything else is read from the job record. Huey
deletes a task when a worker dequeues it, so a worker killed mid-chunk loses the task but not
the work: its rows are journaled per item, and ``requeue_unfinished`` (run at every worker start)
puts back each chunk that has no done marker and no queued task.

The chunk task is registered here under one name so that producers and workers agree on it; what
it runs is set by the worker (``Queue.on_chunk``), so a producer never needs an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Optional

from .. import environment
from ..errors import SetupError
from ..extras import install_hint
from .jobs import JobRecord, list_jobs
from .scaleout import check_sqlite_home, claim_home
from .spec import SpecError

CHUNK_TASK = "dflash_batch.chunk"
RETRY_DELAY_S = 5
REDIS_ENV = "DFLASH_BATCH_REDIS_URL"
REDIS_CHECK_TIMEOUT_S = 5.0  # how long a Redis server has to answer the first ping


def task_id(job_id: str, chunk: int) -> str:
    return f"{job_id}:{chunk:05d}"


def redis_huey(url: str):
    """A ``RedisHuey`` on ``url`` (redis://host:port/db); needs the ``redis`` client package.
    Raises ``SetupError`` unless a Redis server answers a ping there (``check_redis``)."""
    try:
        import redis  # noqa: F401
    except ImportError as e:
        hint = install_hint("redis")
        raise SpecError(f"a Redis queue ({url}) needs the redis client: {hint}") from e
    from huey import RedisHuey

    check_redis(url)
    return RedisHuey(name="dflash-batch", url=url, results=False, utc=True)


def check_redis(url: str, timeout: Optional[float] = None) -> None:
    """Refuse (``SetupError``, naming the URL and the reason) a Redis URL that does not parse, or
    where no Redis server answers a ping within ``timeout`` seconds: a closed port, a host that
    never answers, a server that speaks another protocol. Nothing is written before this."""
    import redis

    timeout = REDIS_CHECK_TIMEOUT_S if timeout is None else timeout
    where = f"--redis / ${REDIS_ENV} {_without_password(url)!r}"
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    except (ValueError, TypeError) as e:
        raise SetupError(f"{where}: not a Redis URL ({e}); expected redis://host:port/db") from None
    try:
        client.ping()
    except redis.TimeoutError:
        raise SetupError(f"{where}: no answer within {timeout:g} s") from None
    except (redis.RedisError, OSError, ValueError) as e:
        reason = f"{type(e).__name__}: {e}"
        raise SetupError(f"{where}: no Redis server answers there ({reason})") from None
    finally:
        client.close()


def _without_password(url: str) -> str:
    """``url`` as messages show it: a password in it replaced by ``***``."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    except ValueError:
        return url


class Queue:
    """The Huey queue with the chunk task on it: a ``SqliteHuey`` at ``home/queue.db`` (one
    machine), or a ``RedisHuey`` when a Redis URL is given or set in $DFLASH_BATCH_REDIS_URL
    (workers on several machines; job records and outputs must then be on shared storage)."""

    def __init__(self, home: Path, redis_url: Optional[str] = None):
        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        redis_url = redis_url or environment.get(REDIS_ENV)
        if redis_url:
            self.huey = redis_huey(redis_url)
            self.broker = redis_url
            claim_home(self.huey.storage, self.home)  # one Redis db serves one (shared) home
        else:
            from huey import SqliteHuey

            check_sqlite_home(self.home)
            # filename= must be given by keyword: the first positional argument is the queue name.
            self.huey = SqliteHuey(
                name="dflash-batch", filename=str(self.home / "queue.db"), results=False, timeout=30
            )
            self.broker = str(self.home / "queue.db")
        self.chunk_task = self.huey.task(name=CHUNK_TASK, context=True)(self._dispatch)
        # (job_id, chunk, task): set by the worker
        self.on_chunk: Optional[Callable[..., None]] = None

    def _dispatch(self, job_id: str, chunk: int, task=None) -> None:
        if self.on_chunk is None:
            raise RuntimeError("chunk tasks run only in `dflash-batch worker` (no worker attached)")
        self.on_chunk(job_id, chunk, task)

    def enqueue_chunk(self, record: JobRecord, chunk: int, delay: Optional[float] = None) -> None:
        retries = record.spec.retries
        if delay:
            self.chunk_task.schedule(
                args=(record.id, chunk),
                delay=delay,
                id=task_id(record.id, chunk),
                retries=retries,
                retry_delay=RETRY_DELAY_S,
            )
        else:
            self.huey.enqueue(
                self.chunk_task.s(
                    record.id,
                    chunk,
                    id=task_id(record.id, chunk),
                    retries=retries,
                    retry_delay=RETRY_DELAY_S,
                )
            )

    def enqueue_job(self, record: JobRecord, chunks: Optional[Iterable[int]] = None) -> int:
        chunks = list(record.pending_chunks() if chunks is None else chunks)
        for c in chunks:
            self.enqueue_chunk(record, c)
        return len(chunks)

    def queued_task_ids(self) -> set:
        """Ids of tasks waiting in the queue or the schedule (read without taking them)."""
        ids = set()
        storage = self.huey.storage
        for data in list(storage.enqueued_items()) + list(storage.scheduled_items()):
            try:
                ids.add(self.huey.serializer.deserialize(data).id)
            except Exception:  # a message from other code: not ours to judge
                continue
        return ids

    def other_jobs_waiting(self, job_id: str) -> bool:
        """Whether a task of another job waits in the queue or the schedule."""
        return any(not t.startswith(f"{job_id}:") for t in self.queued_task_ids())

    def requeue_unfinished(
        self, held: Callable[[JobRecord, int], bool] = lambda record, chunk: False
    ) -> int:
        """Put back every unfinished chunk of every live job that has no task waiting and is not
        ``held`` (under a live lease): the recovery after a killed or hung worker. Extra copies are
        harmless (a held chunk's task is dropped, done ids are skipped). A foreground run's job is
        not the queue's: only its rerun resumes it."""
        queued = self.queued_task_ids()
        n = 0
        for record in list_jobs(self.home):
            if record.cancelled() or record.failure() or record.foreground():
                continue
            for c in record.pending_chunks():
                if task_id(record.id, c) not in queued and not held(record, c):
                    self.enqueue_chunk(record, c)
                    n += 1
        return n
