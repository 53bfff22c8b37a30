"""The processing loop: items -> engine.generate -> rows, checkpointed through the store.

The caller holds the output dir's lock. Finished ids (committed parts and journals) are
skipped, so a rerun, a retry or a restarted worker never generates an item twice.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional

import orjson

from ..completion import GenerationError
from .items import Item
from .spec import JobSpec
from .store import ResultStore

log = logging.getLogger("dflash_batch.runner")
WORKER = f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class ChunkResult:
    generated: int = 0  # items run through the engine (ok or error)
    errors: int = 0
    skipped: int = 0  # already done before this run
    stopped: bool = False  # left early (stop or cancel); the rest is still to do


def _row(item: Item, status: str, started: float, job_id: str, config_hash: str, **fields) -> Dict[str, Any]:
    """The fields every result row carries, plus the status-specific ones."""
    return {
        "id": item.id,
        "status": status,
        **fields,
        "started_at": started,
        "finished_at": time.time(),
        "input_index": item.index,
        "job_id": job_id,
        "config_hash": config_hash,
        "metadata": orjson.dumps(item.metadata, default=str).decode(),
    }


def error_row(item: Item, message: str, started: float, job_id: str, config_hash: str) -> Dict[str, Any]:
    return _row(item, "error", started, job_id, config_hash, error=message)


def generate_row(engine, spec: JobSpec, item: Item, job_id: str, config_hash: str) -> Dict[str, Any]:
    """One item through the engine; a refused prompt or any per-item failure is an error row."""
    started = time.time()
    if item.error is not None:
        return error_row(item, item.error, started, job_id, config_hash)
    opts = item.options
    try:
        completion = engine.generate(
            item.prompt,
            max_tokens=opts.get("max_tokens", spec.max_tokens),
            temperature=opts.get("temperature", spec.temperature),
            stop=opts.get("stop", spec.stop) or None,
            seed=spec.seed,
            system=opts.get("system", spec.system_prompt),
            chat_template=spec.chat_template,
            chat_template_kwargs=spec.chat_template_kwargs or None,
        )
    except Exception as e:  # a refused prompt, or any failure: one bad item must not end the job
        if not isinstance(e, GenerationError):
            log.exception("item %s (%s) failed", item.id, item.where)
        return error_row(item, f"{item.where}: {type(e).__name__}: {e}", started, job_id, config_hash)
    s = completion.stats
    return _row(
        item,
        "ok",
        started,
        job_id,
        config_hash,
        output=completion.text,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        prompt_tokens=s.prompt_tokens,
        completion_tokens=s.generated_tokens,
        prefill_s=s.prefill_s,
        decode_s=s.decode_s,
        prefill_tps=s.prefill_tps,
        decode_tps=s.decode_tps,
        verify_cycles=s.cycles,
        drafted_tokens=s.drafted_tokens,
        accepted_tokens=s.accepted_tokens,
        acceptance_drafted=s.acceptance_drafted,
        acceptance_generated=s.acceptance_generated,
        tokens_per_cycle=s.tokens_per_cycle,
        acceptance_histogram=list(s.acceptance_histogram),
        block_size=s.block_size,
        peak_memory_gb=s.peak_memory_gb,
    )


def process_items(
    engine,
    spec: JobSpec,
    items: Iterable[Item],
    store: ResultStore,
    *,
    chunk: int,
    job_id: str,
    should_stop: Callable[[], bool] = lambda: False,
    on_row: Optional[Callable[[Dict[str, Any]], None]] = None,
    part_rows: Optional[int] = None,
) -> ChunkResult:
    """Generate every item not yet done, journaling each row and committing a part every
    ``part_rows`` rows (default: the chunk size) and at the end, also on stop or error."""
    result = ChunkResult()
    config_hash = spec.config_hash()
    part_rows = part_rows or spec.chunk_size
    store.ensure()
    store.recover()
    done = store.done_ids()
    journal = store.journal(chunk)
    try:
        for item in items:
            if item.id in done:
                result.skipped += 1
                continue
            if should_stop():
                result.stopped = True
                break
            row = generate_row(engine, spec, item, job_id, config_hash)
            journal.append(row)
            done.add(item.id)
            result.generated += 1
            result.errors += row["status"] == "error"
            if on_row is not None:
                on_row(row)
            if len(journal.rows) >= part_rows:
                store.commit_journal(journal, chunk)
                journal = store.journal(chunk)
    finally:
        store.commit_journal(journal, chunk)
    return result
