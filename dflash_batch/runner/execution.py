"""The job loop, the same in the foreground (``run``) and in a queue worker: lock -> recover ->
skip finished -> feed the engine -> commit rows as they finish.

All the chunks given are fed to the engine as one stream of requests, so a batched engine stays
full across chunk boundaries. Each finished row goes to its chunk's journal (fsynced per row);
a chunk's journal becomes a Parquet part when the chunk is complete (or every ``part_rows`` rows,
or on stop or error), and the chunk is then marked done. A process killed at any point leaves
journals that ``store.recover`` commits under the next holder of the lock: every id exactly once.

The engine comes from ``engines(spec)``, any ``request.CompletionEngine``: the caller decides how
models are loaded and kept (the worker keeps one resident; the foreground run loads one).
Nothing here imports MLX.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

from ..completion import GenerationError
from ..errors import ConfigChanged
from ..files import write_atomic
from ..request import CompletionEngine, Request, control_row, sample_seed
from . import saved
from .jobs import JobRecord, counts_text
from .lease import LeaseLost
from .lock import DirLock
from .rows import item_error_row, outcome_row
from .spec import JobSpec
from .store import Journal, key_of, row_key

log = logging.getLogger("dflash_batch.runner")
EngineSource = Callable[[JobSpec], CompletionEngine]


@dataclass
class RunResult:
    generated: int = 0  # rows written by this run (ok or error)
    errors: int = 0
    skipped: int = 0  # rows of the given chunks already done before this run
    stopped: bool = False  # left early (stop or cancel); the rest is still to do
    chunks_done: List[int] = field(default_factory=list)


def run_job(
    record: JobRecord,
    chunks: Optional[Iterable[int]] = None,
    engines: Optional[EngineSource] = None,
    should_stop: Callable[[], bool] = lambda: False,
    on_row: Optional[Callable[[Dict[str, Any]], None]] = None,
    part_rows: Optional[int] = None,
    lease: Optional[Callable[[], bool]] = None,
) -> RunResult:
    """Run the given chunks (default: all pending) of a job under the output dir's lock (raises
    ``lock.Locked`` at once if another live process holds it). Stops between rows when
    ``should_stop()`` or the job is cancelled; ``stopped`` then says there is work left (rows in
    flight are dropped, not written: they are generated again by the next run).

    ``lease`` (a queue worker's): the chunks are held by a lease, not by the whole dir. The dir
    lock is then shared with other workers (the foreground run takes it alone), only these chunks'
    journals are recovered, and no row or part is written once ``lease()`` is false (raises
    ``LeaseLost``)."""
    if record.cancelled():
        return RunResult(stopped=True)
    wanted = [
        c
        for c in (record.pending_chunks() if chunks is None else chunks)
        if not record.chunk_done(c)
    ]
    result = RunResult()
    if wanted:
        spec = record.spec
        with DirLock(record.output_dir, shared=lease is not None):
            _check_config(record)
            _feed(record, [c for c in wanted if not record.chunk_done(c)], engines, result,
                  lambda: should_stop() or record.cancelled(), on_row, part_rows or spec.chunk_size, lease)  # fmt: skip
    if wanted and not result.stopped and not record.pending_chunks():
        finish_job(record)
    return result


def run_chunk(
    record: JobRecord, chunk: int, engines: EngineSource, should_stop=lambda: False, on_row=None
) -> RunResult:
    """``run_job`` for one chunk."""
    return run_job(record, [chunk], engines, should_stop, on_row)


def _check_config(record: JobRecord) -> None:
    claimed = record.store().manifest().get("config_hash")
    if claimed and claimed != record.data["config_hash"] and not record.spec.force:
        raise ConfigChanged(
            f"{record.output_dir} now holds results of config {claimed}, this job has "
            f"{record.data['config_hash']}; resubmit with force (--force, force=True) to add to it"
        )


def _feed(
    record, chunks, engines, result: RunResult, should_stop, on_row, part_rows: int, lease=None
) -> None:
    """The loop itself (the lock is held)."""
    spec = record.spec
    store = record.store()
    store.ensure()
    store.recover(chunks if lease is not None else None)  # other chunks' journals may be live

    def held() -> bool:  # may this process still write rows of these chunks?
        if lease is None or lease():
            return True
        raise LeaseLost(
            f"lease on chunk(s) {chunks} of {record.id} lost: another worker has them now"
        )

    done = store.done_ids()
    only = record.retry_ids()
    config_hash = record.data["config_hash"]
    todo = []  # (chunk, item, sample index): one result row each
    for c in chunks:
        for item in record.items(c):
            samples = range(1 if item.error is not None else spec.options(item.options).n)
            missing = [k for k in samples if row_key(item.id, k) not in done]
            if not missing:
                result.skipped += 1
            elif only is None or item.id in only:
                todo += [(c, item, k) for k in missing]
    left = Counter(c for c, _, _ in todo)
    chunk_of: Dict[Any, int] = {row_key(item.id, k): c for c, item, k in todo}
    journals: Dict[int, Journal] = {}

    def close_chunk(c: int) -> None:
        held()
        if c in journals:
            store.commit_journal(journals.pop(c), c)
        record.mark_chunk_done(c)
        result.chunks_done.append(c)

    def commit(row: Dict[str, Any]) -> None:
        c = chunk_of[key_of(row)]
        held()
        journal = journals.get(c) or journals.setdefault(c, store.journal(c))
        journal.append(row)
        done.add(key_of(row))
        result.generated += 1
        result.errors += row["status"] == "error"
        if on_row is not None:
            on_row(row)
        left[c] -= 1
        if left[c] == 0:
            close_chunk(c)
        elif len(journal.rows) >= part_rows and held():
            store.commit_journal(journals.pop(c), c)

    handed: Dict[str, float] = {}

    def requests() -> Iterator[Request]:
        """One request per sample still to do: the row's options, n = 1, the sample's own seed."""
        for _, item, k in todo:
            if item.error is None:
                handed[item.id] = time.time()
                options = spec.options(item.options)
                options = replace(options, n=1, seed=sample_seed(options.seed, k, item.id))
                yield Request(
                    item.id,
                    item.prompt,
                    options,
                    item.metadata,
                    item.index,
                    item.where,
                    sample_index=k,
                    control=control_row(spec.control, item.id, k),
                )

    try:
        for c in chunks:
            if not left[c]:
                close_chunk(c)
        if should_stop():
            result.stopped = bool(todo)
            return
        for _, item, _k in todo:
            if item.error is not None:
                commit(item_error_row(item, record.id, config_hash))
        if any(item.error is None for _, item, _k in todo):
            engine = engines(spec)
            # one drafter per stream (drafters.py)
            revision = getattr(engine, "drafter_revision", None)
            for request, outcome in engine.generate_requests(requests(), spec.batch_size):
                if isinstance(outcome, Exception) and not isinstance(outcome, GenerationError):
                    log.error(
                        "item %s (%s) failed: %s: %s",
                        request.id,
                        request.where,
                        type(outcome).__name__,
                        outcome,
                    )
                row = outcome_row(
                    request, outcome, handed.get(request.id, time.time()), record.id, config_hash
                )
                commit(dict(row, drafter_revision=revision))
                if any(left.values()) and should_stop():
                    result.stopped = True
                    break
    finally:
        keep = lease is None or lease()  # a lost lease: the journal is the next holder's to commit
        for c in list(journals):
            journal = journals.pop(c)
            store.commit_journal(journal, c) if keep else journal.close()
    if any(left.values()) and not result.stopped:
        # the engine yielded fewer rows than it was given: never finish a chunk short
        result.stopped = True
        log.error("job %s: the engine returned %d rows too few", record.id, sum(left.values()))


def finish_job(record: JobRecord) -> None:
    """When the last chunk is done: record it in the manifest, export if asked."""
    store = record.store()
    (record.dir / "retry_ids.json").unlink(missing_ok=True)
    if record.spec.export_openai:
        import io

        from .export import write_lines

        buf = io.BytesIO()
        write_lines(store.read(), buf, "openai", model=record.spec.model_name)
        write_atomic(store.dir / "_openai_output.jsonl", buf.getvalue())
    store.write_manifest(last_completed_job=record.id)
    status = record.status()
    log.info("job %s completed: %s", record.id, counts_text(status))
    said = saved.text(status["speculation"])
    if said:
        log.info("job %s %s", record.id, said.replace("\n", "; "))
