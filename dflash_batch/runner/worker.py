"""The consumer side of the queue: one resident engine and the loop that runs chunk tasks.

``Worker.run_chunk`` executes one chunk task (the unit a lease or a retry wraps); ``Worker.run``
is the worker loop (recover, catch up cron, then Huey's consumer until a signal).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import orjson

from .. import environment
from . import drafters
from .cron import Cron, schedule_files
from .execution import ConfigChanged, run_job
from .items import InputError
from .jobs import JobNotFound, JobRecord, load_job
from .lease import Heartbeat, Lease, LeaseLost, Leases, Rate, new_worker_id, scope_of
from .lock import Locked
from .queue import Queue
from .spec import JobSpec, SpecError

log = logging.getLogger("dflash_batch.worker")
LOCK_RETRY_S = 2.0  # a chunk whose output dir is busy goes back on the queue for this long
DISK_FULL_RETRY_S = 10.0  # a chunk that hit a full disk is tried again after this long
STREAM_BATCHES = 8  # a task runs chunks of its job up to this many batches of rows, in one stream
STREAM_BATCH_DEFAULT = 32  # the batch assumed for that when the job leaves batch_size to memory


class EngineSlot:
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
            log.info(
                "loading engine %s in thread %s", key.decode(), threading.current_thread().name
            )
            self.engine = self.factory(**model)
            self.key, self.thread = key, threading.current_thread().name
            log.info("engine ready: %s", getattr(self.engine, "description", model))
        return self.engine


class Worker:
    """One queue consumer with one thread and one resident engine."""

    def __init__(
        self,
        queue: Queue,
        engine_factory: Callable[..., Any],
        device: Optional[str] = None,
        adapter: Optional[Callable[..., Any]] = None,
    ):
        self.queue = queue
        self.engine_slot = EngineSlot(engine_factory)
        # training/adapt.py's ``adapt_job`` (the runner imports no training code): runs a job
        # spec's ``adapt:`` between its tasks; None: never
        self.adapter = adapter
        self.cron = Cron(queue)
        self.stop_flag: Optional[threading.Event] = None
        # late-bound: wrappable
        queue.on_chunk = lambda job_id, chunk, task: self.run_chunk(job_id, chunk, task)
        self.id = new_worker_id()
        self.device = device if device is not None else environment.get("CUDA_VISIBLE_DEVICES")
        self.leases = Leases(queue.huey.storage)
        self.rate = Rate()
        self.held: List[Lease] = []  # the leases of the chunks this worker runs now
        self.heartbeat = Heartbeat(
            self.leases, self.id, lambda: list(self.held), self.record, self.reap
        )

    def stopping(self) -> bool:
        return self.stop_flag is not None and self.stop_flag.is_set()

    def run_chunk(self, job_id: str, chunk: int, task=None) -> None:
        """Execute one chunk task: the rows of ``chunk`` of the job (with ``chunks_to_run``'s
        others), batched, committed as they finish. A busy output dir requeues the chunk; a job-level error fails the job; any other
        error is raised for Huey to retry while the task has retries left."""
        queue = self.queue
        try:
            record = load_job(queue.home, job_id)
        except JobNotFound:
            log.warning("chunk %d of unknown job %s dropped", chunk, job_id)
            return
        if record.chunk_done(chunk):
            return
        if record.foreground():  # a `run`'s job: its own rerun resumes it, a worker never does
            log.info("chunk %d of %s dropped: a foreground run's job", chunk, job_id)
            return
        lease = self._acquire(record, chunk)
        if lease is None:  # another worker has it; its lease brings the chunk back if it dies
            log.info(
                "chunk %d of %s is held by %s: dropped", chunk, job_id, self._holder(record, chunk)
            )
            return
        self.held = [lease]
        try:
            self._run_leased(record, chunk, task)
        finally:
            self._release()
        self.adapt_if_due(record)

    def adapt_if_due(self, record: JobRecord) -> None:
        """A job spec's ``adapt:``, once its rows are in: between tasks, with no chunk held, so
        rows are all committed and a kill -9 here loses none (drafters.py). A failure is
        recorded in the job's drafter history and never fails the job."""
        if (
            self.adapter is None
            or self.stopping()
            or record.cancelled()
            or not drafters.adapt_due(record)
        ):
            return
        try:
            with drafters.adapt_lock(record):
                if drafters.adapt_due(record):  # another worker may have just done it
                    self.adapter(record, trigger="spec", **record.spec.adapt)
        except Locked:
            log.info("job %s: another process adapts its drafter", record.id)
        except Exception as e:
            log.exception("job %s: adapting its drafter failed", record.id)
            drafters.record_attempt(record, {"revision": None, "outcome": "failed", "trigger": "spec",
                                             "note": f"{type(e).__name__}: {e}"})  # fmt: skip

    def _acquire(self, record: JobRecord, chunk: int) -> Optional[Lease]:
        return self.leases.acquire(scope_of(record.output_dir), chunk, worker=self.id, host=socket.gethostname(),
                                   job=record.id, output_dir=str(record.output_dir))  # fmt: skip

    def _release(self) -> None:
        held, self.held = self.held, []
        for lease in held:
            try:
                self.leases.release(lease)
            except Exception as e:  # the queue is down: the lease lapses by itself
                log.warning("lease on chunk %d of %s not released (%s); it expires in %.0f s",
                            lease.record["chunk"], lease.record["job"], e, self.leases.ttl)  # fmt: skip

    def _holding(self) -> bool:
        """May this worker still write rows of the chunks it runs (every lease valid)?"""
        return all(lease.valid() for lease in self.held)

    def _requeue(self, record: JobRecord, chunk: int, delay: Optional[float] = None) -> None:
        self._release()  # free before the task is back, or its taker drops it
        self.queue.enqueue_chunk(record, chunk, delay=delay)

    def _holder(self, record: JobRecord, chunk: int) -> str:
        holder = self.leases.holder(scope_of(record.output_dir), chunk)
        return holder["worker"] if holder else "another worker"

    def _on_row(self, row: Dict[str, Any]) -> None:
        self.rate.add(row.get("completion_tokens") or 0)

    def _warm_up(self, spec) -> None:
        """Before a chunk's first item: the engine's warm-up for the job's batch size (compiling
        passes, timing them or reading their costs from the model cache), logged, so that it is
        not silently paid inside the first items. An engine without ``prepare`` has none."""
        prepare = getattr(self.engine_slot(spec), "prepare", None)
        done = prepare(spec.batch_size, spec.max_tokens) if prepare is not None else None
        if done:
            log.info(
                "warmed up for batch size %d (context %d) in %.1f s: pass costs %s",
                done["batch_size"],
                done["context"],
                done["seconds"],
                "read from the model cache" if done["read"] else "measured",
            )

    def _run_leased(self, record: JobRecord, chunk: int, task=None) -> None:
        job_id = record.id
        try:
            self._warm_up(record.spec)
            chunks = self.chunks_to_run(record, chunk)
            engines = lambda spec: drafters.use_in_force(self.engine_slot(spec), record)  # noqa: E731
            result = run_job(record, chunks, engines, should_stop=lambda: self.stopping() or not self._holding(),
                             on_row=self._on_row, lease=self._holding)  # fmt: skip
        except LeaseLost as e:  # hung past the lease: the chunks are another worker's now
            log.warning("%s; this worker leaves them", e)
            return
        except Locked as e:
            log.info("chunk %d of %s waits: %s", chunk, job_id, e)
            self._requeue(record, chunk, LOCK_RETRY_S)
            return
        except (ConfigChanged, InputError, SpecError) as e:
            log.error("job %s failed: %s", job_id, e)
            record.mark_failed(str(e))
            return
        except Exception as e:
            if isinstance(e, OSError) and e.errno in (
                errno.ENOSPC,
                errno.EDQUOT,
            ):  # transient: wait for space
                log.error(
                    "chunk %d of %s: disk full (%s); requeued in %.0f s",
                    chunk,
                    job_id,
                    e,
                    DISK_FULL_RETRY_S,
                )
                self._requeue(record, chunk, DISK_FULL_RETRY_S)
                return
            if task is not None and task.retries:
                log.exception("chunk %d of %s failed; %d retries left", chunk, job_id, task.retries)
                raise
            log.exception("job %s failed", job_id)
            record.mark_failed(f"{type(e).__name__}: {e}")
            return
        if result.stopped and not self._holding():
            log.warning("chunk(s) %s of %s: lease lost; this worker leaves them", chunks, job_id)
        elif result.stopped and not record.cancelled():
            pending = record.pending_chunks()
            again = chunk if chunk in pending or not pending else pending[0]
            log.info(
                "chunk %d of %s checkpointed (%d items done); requeued",
                again,
                job_id,
                result.generated,
            )
            self._requeue(record, again)
        else:
            log.info(
                "chunk %d of %s (with chunks %s): %d generated (%d errors), %d already done",
                chunk, job_id, result.chunks_done, result.generated, result.errors, result.skipped,
            )  # fmt: skip

    def chunks_to_run(self, record, chunk: int) -> List[int]:
        """The task's chunk and, while no other job has a task waiting, more of the job's pending
        chunks that this worker can lease: one stream of requests, so the batched engine stays
        full across chunk boundaries. It takes this worker's share of the pending chunks (split
        among the live workers of the queue, and never more than half: a worker that starts
        later still finds chunks) and at most ``STREAM_BATCHES`` batches of rows. The
        extra chunks' tasks stay queued: each finds its chunk done (or held) and returns; after a
        kill -9 the leases lapse and the reaper brings back what was not done. With other jobs
        waiting, jobs interleave chunk by chunk."""
        if self.queue.other_jobs_waiting(record.id):
            return [chunk]
        spec, pending = record.spec, record.pending_chunks()
        live = len({w["id"] for w in self.leases.workers(within=self.leases.ttl)} | {self.id})
        share = -(-len(pending) // max(live, 2))  # ceil
        most = max(
            1,
            min(
                share, STREAM_BATCHES * (spec.batch_size or STREAM_BATCH_DEFAULT) // spec.chunk_size
            ),
        )
        chunks = [chunk]
        for c in pending:
            if len(chunks) >= most:
                break
            lease = self._acquire(record, c) if c != chunk else None
            if lease is not None:
                self.held.append(lease)
                chunks.append(c)
        return chunks

    def preload(self, model: Dict[str, Any]) -> None:
        """Load ``model`` when the consumer starts, in its worker thread (where MLX objects live)."""

        @self.queue.huey.on_startup(name="dflash_batch.load_engine")
        def load_engine_in_worker_thread():
            self.engine_slot.get(model)

    def run(
        self, *, periodic: bool = True, shutdown_timeout: float = 30.0, poll_max_delay: float = 2.0
    ) -> None:
        """The worker loop: requeue lost chunks, catch up missed cron runs, then consume tasks
        until SIGINT or SIGTERM (both graceful: the current item finishes, its chunk is
        checkpointed and requeued)."""
        requeued = self.reap()
        if requeued:
            log.info("requeued %d unfinished chunk(s)", requeued)
        if periodic:  # the worker that runs the cron also makes up for runs missed while none did
            self.cron.catch_up()
        consumer = self.queue.huey.create_consumer(
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
        self.stop_flag = consumer.stop_flag
        log.info("worker started: queue %s, home %s, id %s, device %s, leases of %.0f s",
                 self.queue.broker, self.queue.home, self.id, self.device, self.leases.ttl)  # fmt: skip
        # seen at once: other workers count it in their shares
        self.leases.put_worker(self.id, **self.record())
        self.heartbeat.start()
        try:
            consumer.run()
        finally:
            self.heartbeat.stop()

    def reap(self) -> int:
        """Requeue the unfinished chunks nobody holds or waits for: a dead or hung holder's."""
        return self.queue.requeue_unfinished(
            held=lambda record, c: self.leases.holder(scope_of(record.output_dir), c) is not None
        )

    def record(self) -> Dict[str, Any]:
        """What ``status`` shows of this worker."""
        live = [lease for lease in list(self.held) if not lease.lost]
        held = (
            f"{live[0].record['job']}:{','.join(str(l.record['chunk']) for l in live)}"
            if live
            else None
        )
        return dict(host=socket.gethostname(), pid=os.getpid(), device=self.device, broker=self.queue.broker,
                    chunk=held, **self.rate.rates())  # fmt: skip


def run_worker(
    home: Path,
    engine_factory: Callable[..., Any],
    *,
    preload: Optional[Dict[str, Any]] = None,
    schedules: Iterable[Path] = (),
    periodic: bool = True,
    shutdown_timeout: float = 30.0,
    poll_max_delay: float = 2.0,
    device: Optional[str] = None,
    adapter: Optional[Callable[..., Any]] = None,
) -> None:
    """``dflash-batch worker``: a ``Worker`` on the home's queue with its schedules."""
    worker = Worker(Queue(home), engine_factory, device=device, adapter=adapter)
    for path in schedule_files(worker.queue.home, schedules):
        worker.cron.add_schedule(path)
    if preload is not None:
        worker.preload(preload)
    worker.run(periodic=periodic, shutdown_timeout=shutdown_timeout, poll_max_delay=poll_max_delay)
