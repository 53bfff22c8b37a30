"""Running one chunk of a job, the same way in the foreground and in a queue worker.

An engine comes from ``engines(spec)``: the caller decides how models are loaded and kept
(the worker keeps one resident; the foreground run loads one). Nothing here imports MLX.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from .jobs import JobRecord
from .lock import DirLock
from .process import ChunkResult, process_items
from .spec import JobSpec
from .store import write_atomic

log = logging.getLogger("dflash_batch.runner")
EngineSource = Callable[[JobSpec], Any]


class ConfigChanged(RuntimeError):
    """The output dir was claimed by another config after this job was submitted."""


def run_chunk(
    record: JobRecord,
    chunk: int,
    engines: EngineSource,
    should_stop: Callable[[], bool] = lambda: False,
    on_row: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> ChunkResult:
    """Process one chunk under the output dir's lock (raises ``lock.Locked`` at once if another
    live process holds it). Stops between items when ``should_stop()`` or the job is cancelled;
    the result's ``stopped`` then says the chunk has work left."""
    if record.cancelled():
        return ChunkResult(stopped=True)
    if record.chunk_done(chunk):
        return ChunkResult()
    spec = record.spec
    store = record.store()
    with DirLock(record.output_dir):
        claimed = store.manifest().get("config_hash")
        if claimed and claimed != record.data["config_hash"] and not spec.force:
            raise ConfigChanged(
                f"{record.output_dir} now holds results of config {claimed}, this job has "
                f"{record.data['config_hash']}; resubmit with --force to add to it"
            )
        store.ensure()
        store.recover()
        done = store.done_ids()
        only = record.retry_ids()
        todo = [i for i in record.items(chunk) if i.id not in done and (only is None or i.id in only)]
        result = ChunkResult()
        if todo:
            engine = engines(spec)
            result = process_items(
                engine,
                spec,
                todo,
                store,
                chunk=chunk,
                job_id=record.id,
                should_stop=lambda: should_stop() or record.cancelled(),
                on_row=on_row,
            )
        if not result.stopped:
            record.mark_chunk_done(chunk)
    if not result.stopped and not record.pending_chunks():
        finish_job(record)
    return result


def finish_job(record: JobRecord) -> None:
    """When the last chunk is done: record it in the manifest, export if asked."""
    store = record.store()
    (record.dir / "retry_ids.json").unlink(missing_ok=True)
    if record.spec.export_openai:
        import io

        from .export import write_lines

        buf = io.BytesIO()
        write_lines(store.read(), buf, "openai", model=record.spec.target)
        write_atomic(store.dir / "_openai_output.jsonl", buf.getvalue())
    store.write_manifest(last_completed_job=record.id)
    status = record.status()
    log.info("job %s completed: %d ok, %d failed", record.id, status["ok"], status["failed"])
