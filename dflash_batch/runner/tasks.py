"""The Huey queue: chunk tasks, the resident-engine worker, and cron schedules from YAML.

Tasks carry only ``(job_id, chunk)``; everything else is read from the job record. Huey deletes
a task when it is dequeued, so a worker killed mid-chunk loses the task but not the work: its
rows are journaled per item, and ``requeue_unfinished`` (run at every worker start) puts back
each chunk that has no done marker and no queued task.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import orjson

from .. import checks
from .execution import ConfigChanged, run_job
from .items import InputError
from .jobs import JobNotFound, JobRecord, create_job, list_jobs, load_job
from .lock import Locked
from .spec import JobSpec, SpecError, cron_fields, default_name, load_spec

log = logging.getLogger("dflash_batch.worker")
CHUNK_TASK = "dflash_batch.chunk"
LOCK_RETRY_S = 2.0  # a chunk whose output dir is busy goes back on the queue for this long
RETRY_DELAY_S = 5
REDIS_ENV = "DFLASH_BATCH_REDIS_URL"
CATCH_UP_DAYS = 35  # how far back a starting worker looks for a missed cron run


class ScheduleNotFound(LookupError):
    pass


def redis_huey(url: str):
    """A ``RedisHuey`` on ``url`` (redis://host:port/db); needs the ``redis`` client package."""
    try:
        import redis  # noqa: F401
    except ImportError as e:
        raise SpecError(f"a Redis queue ({url}) needs the redis client: pip install 'dflash-batch[redis]'") from e
    from huey import RedisHuey

    return RedisHuey(name="dflash-batch", url=url, results=False, utc=True)


def last_due(expression: str, since: datetime.datetime, now: datetime.datetime) -> Optional[datetime.datetime]:
    """The latest minute in (since, now] that the cron expression matches (UTC, naive
    datetimes), looking back at most CATCH_UP_DAYS; None if there is none."""
    from huey import crontab

    due = crontab(**cron_fields(expression))
    minute = datetime.timedelta(minutes=1)
    t = now.replace(second=0, microsecond=0)
    floor = max(since, now - datetime.timedelta(days=CATCH_UP_DAYS))
    while t > floor:
        if due(t):
            return t
        t -= minute
    return None


def next_due(expression: str, now: datetime.datetime) -> Optional[datetime.datetime]:
    """The first minute after ``now`` that the cron expression matches (UTC, naive datetimes),
    looking ahead at most CATCH_UP_DAYS; None if there is none."""
    from huey import crontab

    due = crontab(**cron_fields(expression))
    minute = datetime.timedelta(minutes=1)
    t = now.replace(second=0, microsecond=0) + minute
    ceiling = now + datetime.timedelta(days=CATCH_UP_DAYS)
    while t <= ceiling:
        if due(t):
            return t
        t += minute
    return None


def last_run_path(home: Path, schedule_file: Path) -> Path:
    """Where a schedule's last run is recorded: one file per schedule file, by its stem (unique
    in the schedules folder)."""
    try:
        return checks.path_under(Path(home) / "schedules" / ".last-run", Path(schedule_file).stem)
    except checks.BadValue as e:
        raise SpecError(f"{schedule_file}: its file name cannot name a schedule: {e}") from None


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def task_id(job_id: str, chunk: int) -> str:
    return f"{job_id}:{chunk:05d}"


class Engines:
    """The worker's resident engine: loaded on first use in the calling (worker) thread, kept
    across jobs, replaced only when a job names a different model."""

    def __init__(self, factory: Callable[..., Any]):
        self.factory = factory
        self.engine = None
        self.key: Optional[bytes] = None
        self.thread: Optional[str] = None

    def __call__(self, spec: JobSpec):
        return self.get(spec.model)

    def get(self, model: Dict[str, Any]):
        key = orjson.dumps(model, option=orjson.OPT_SORT_KEYS)
        if self.engine is None or key != self.key:
            if self.engine is not None:
                log.info("releasing engine %s for a job with another model", self.key.decode())
            self.engine = None  # drop the old model before loading the next
            log.info("loading engine %s in thread %s", key.decode(), threading.current_thread().name)
            self.engine = self.factory(**model)
            self.key, self.thread = key, threading.current_thread().name
            log.info("engine ready: %s", getattr(self.engine, "description", model))
        return self.engine


class Queue:
    """The Huey queue with the chunk task on it: a ``SqliteHuey`` at ``home/queue.db`` (one
    machine), or a ``RedisHuey`` when a Redis URL is given or set in $DFLASH_BATCH_REDIS_URL
    (workers on several machines; job records and outputs must then be on shared storage)."""

    def __init__(self, home: Path, redis_url: Optional[str] = None):
        self.home = Path(home).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        redis_url = redis_url or os.environ.get(REDIS_ENV) or None
        if redis_url:
            self.huey = redis_huey(redis_url)
            self.broker = redis_url
        else:
            from huey import SqliteHuey

            # filename= must be given by keyword: the first positional argument is the queue name.
            self.huey = SqliteHuey(name="dflash-batch", filename=str(self.home / "queue.db"), results=False, timeout=30)
            self.broker = str(self.home / "queue.db")
        self.chunk_task = self.huey.task(name=CHUNK_TASK, context=True)(self._run_chunk)
        self.engines: Optional[Engines] = None
        self.stop_flag: Optional[threading.Event] = None
        self.schedules: Dict[str, Tuple[str, Path]] = {}  # name -> (cron expression, YAML file)

    # -- producer side ----------------------------------------------------------------------
    def enqueue_chunk(self, record: JobRecord, chunk: int, delay: Optional[float] = None) -> None:
        retries = record.spec.retries
        if delay:
            self.chunk_task.schedule(
                args=(record.id, chunk), delay=delay, id=task_id(record.id, chunk), retries=retries, retry_delay=RETRY_DELAY_S
            )
        else:
            self.huey.enqueue(
                self.chunk_task.s(record.id, chunk, id=task_id(record.id, chunk), retries=retries, retry_delay=RETRY_DELAY_S)
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

    def requeue_unfinished(self) -> int:
        """Put back every unfinished chunk of every live job that has no task waiting: the
        recovery after a killed worker. Extra copies are harmless (done ids are skipped)."""
        queued = self.queued_task_ids()
        n = 0
        for record in list_jobs(self.home):
            if record.cancelled() or record.failure():
                continue
            for c in record.pending_chunks():
                if task_id(record.id, c) not in queued:
                    self.enqueue_chunk(record, c)
                    n += 1
        return n

    # -- worker side --------------------------------------------------------------------------
    def stopping(self) -> bool:
        return self.stop_flag is not None and self.stop_flag.is_set()

    def _run_chunk(self, job_id: str, chunk: int, task=None) -> None:
        try:
            record = load_job(self.home, job_id)
        except JobNotFound:
            log.warning("chunk %d of unknown job %s dropped", chunk, job_id)
            return
        if self.engines is None:
            raise RuntimeError("chunk tasks run only in `dflash-batch worker` (no engine factory set)")
        try:
            # One chunk per task, batched within the chunk. (Taking every pending chunk of the
            # job here kept the batch full across chunks, but a kill -9 then left the lost task's
            # chunk done and nothing for requeue_unfinished to restore; not yet reconciled.)
            result = run_job(record, [chunk], self.engines, should_stop=self.stopping)
        except Locked as e:
            log.info("chunk %d of %s waits: %s", chunk, job_id, e)
            self.enqueue_chunk(record, chunk, delay=LOCK_RETRY_S)
            return
        except (ConfigChanged, InputError, SpecError) as e:
            log.error("job %s failed: %s", job_id, e)
            record.mark_failed(str(e))
            return
        except Exception as e:
            if task is not None and task.retries:
                log.exception("chunk %d of %s failed; %d retries left", chunk, job_id, task.retries)
                raise
            log.exception("job %s failed", job_id)
            record.mark_failed(f"{type(e).__name__}: {e}")
            return
        if result.stopped and not record.cancelled():
            pending = record.pending_chunks()
            again = chunk if chunk in pending or not pending else pending[0]
            log.info("chunk %d of %s checkpointed (%d items done); requeued", again, job_id, result.generated)
            self.enqueue_chunk(record, again)
        else:
            log.info(
                "chunk %d of %s (with chunks %s): %d generated (%d errors), %d already done",
                chunk, job_id, result.chunks_done, result.generated, result.errors, result.skipped,
            )  # fmt: skip

    # -- cron ---------------------------------------------------------------------------------
    def add_schedule(self, path: Path) -> Optional[Tuple[str, str]]:
        """Register a YAML job's ``schedule`` as a Huey periodic task that submits the job
        (re-reading the YAML each time, so edits apply). Raises ``SpecError`` for a bad spec."""
        from huey import crontab

        spec = load_spec(path)
        if not spec.schedule:
            return None
        name = spec.name or default_name(spec.input)
        last_run_path(self.home, path)  # refuses a file name that cannot name its state file

        def submit_scheduled():
            now = utcnow()
            ran = self.recorded_run(name)
            if ran is not None and ran >= now.replace(second=0, microsecond=0):
                return  # a start-up catch-up already submitted it this minute
            self.submit_schedule(name, path, now)

        self.huey.periodic_task(crontab(**cron_fields(spec.schedule)), name=f"dflash_batch.cron.{name}")(submit_scheduled)
        self.schedules[name] = (spec.schedule, Path(path))
        log.info("schedule registered: %s at %r (UTC) from %s", name, spec.schedule, path)
        return name, spec.schedule

    def submit_schedule(self, name: str, path: Path, when: datetime.datetime) -> JobRecord:
        """Submit a scheduled job now (re-reading its YAML) and record ``when`` as its last run."""
        record = create_job(load_spec(path), self.home)
        n = self.enqueue_job(record)
        state = self.last_run_file(name)
        state.parent.mkdir(parents=True, exist_ok=True)
        tmp = state.with_suffix(".tmp")
        tmp.write_text(when.isoformat(timespec="seconds"))
        os.replace(tmp, state)
        log.info("schedule %s submitted job %s (%d chunks)", name, record.id, n)
        return record

    def last_run_file(self, name: str) -> Path:
        return last_run_path(self.home, self.schedules[name][1])

    def recorded_run(self, name: str) -> Optional[datetime.datetime]:
        """When the schedule last submitted its job (UTC), if it ever did."""
        f = self.last_run_file(name)
        return datetime.datetime.fromisoformat(f.read_text().strip()) if f.exists() else None

    def last_run(self, name: str) -> datetime.datetime:
        """When the schedule last submitted its job; if never, when its YAML was last written."""
        ran = self.recorded_run(name)
        if ran is not None:
            return ran
        mtime = self.schedules[name][1].stat().st_mtime
        return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).replace(tzinfo=None)

    def catch_up(self, now: Optional[datetime.datetime] = None) -> List[JobRecord]:
        """Submit once each registered schedule whose latest due run (within CATCH_UP_DAYS) came
        after its last run: runs missed while no worker was up. One job however many were
        missed (anacron's rule); a spec with ``catch_up: false`` is left to its next time."""
        now = now or utcnow()
        submitted = []
        for name, (expression, path) in self.schedules.items():
            missed = last_due(expression, self.last_run(name), now)
            if missed is None:
                continue
            if not load_spec(path).catch_up:
                log.info("schedule %s missed its run at %s UTC; catch_up is off", name, missed)
                continue
            log.info("schedule %s missed its run at %s UTC: submitting it now", name, missed)
            try:
                submitted.append(self.submit_schedule(name, path, now))
            except (SpecError, InputError, OSError) as e:  # the worker starts all the same
                log.error("schedule %s: could not submit the missed run: %s", name, e)
        return submitted


def schedule_files(home: Path, extra: Iterable[Path] = ()) -> List[Path]:
    """``$DFLASH_BATCH_HOME/schedules/*.yaml`` plus the given files or folders of YAML."""
    out: List[Path] = []
    for source in [Path(home) / "schedules", *map(Path, extra)]:
        if source.is_dir():
            out += sorted(p for p in source.iterdir() if p.suffix in (".yaml", ".yml"))
        elif source.exists():
            out.append(source)
        elif source != Path(home) / "schedules":
            raise SpecError(f"{source}: no such schedule file or folder")
    return out


def run_worker(
    home: Path,
    engine_factory: Callable[..., Any],
    *,
    preload: Optional[Dict[str, Any]] = None,
    schedules: Iterable[Path] = (),
    periodic: bool = True,
    shutdown_timeout: float = 30.0,
    poll_max_delay: float = 2.0,
) -> None:
    """Run the consumer: one thread worker holding one resident engine. SIGINT and SIGTERM both
    stop gracefully: the current item finishes, its chunk is checkpointed and requeued."""
    queue = Queue(home)
    queue.engines = Engines(engine_factory)
    for path in schedule_files(queue.home, schedules):
        queue.add_schedule(path)

    if preload is not None:

        @queue.huey.on_startup(name="dflash_batch.load_engine")
        def load_engine_in_worker_thread():
            queue.engines.get(preload)  # MLX objects are created in the worker thread

    requeued = queue.requeue_unfinished()
    if requeued:
        log.info("requeued %d unfinished chunk(s)", requeued)
    if periodic:  # the worker that runs the cron also makes up for runs missed while none did
        queue.catch_up()
    consumer = queue.huey.create_consumer(
        workers=1,
        worker_type="thread",
        periodic=periodic,
        max_delay=poll_max_delay,
        check_worker_health=True,
        shutdown_timeout=shutdown_timeout,
        graceful_signal="TERM",
    )
    # Huey makes the other signal an immediate stop; with a thread worker that would abandon
    # the item mid-way. Both are graceful here: the loop sees the stop flag between items.
    consumer._signal_actions[signal.SIGINT] = (False, True)
    queue.stop_flag = consumer.stop_flag
    log.info("worker started: queue %s, home %s", queue.broker, queue.home)
    consumer.run()
