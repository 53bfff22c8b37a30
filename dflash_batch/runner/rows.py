"""Result rows: one per input row, from a ``Request`` and its outcome (or from a row that never
became a request). The columns are ``store.RESULT_SCHEMA``; a completion's statistics map one to
one onto them."""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict

import orjson

from ..completion import Completion
from ..request import Request
from .items import Item

WORKER = f"{socket.gethostname()}:{os.getpid()}"


def _row(
    item, status: str, started: float, job_id: str, config_hash: str, **fields
) -> Dict[str, Any]:
    """The fields every result row carries, plus the status-specific ones (``item``: an ``Item``
    or a ``Request``, both have id, index and metadata)."""
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
        "sample_index": getattr(item, "sample_index", 0),
    }


def error_row(item, message: str, started: float, job_id: str, config_hash: str) -> Dict[str, Any]:
    return _row(item, "error", started, job_id, config_hash, error=message)


def item_error_row(item: Item, job_id: str, config_hash: str) -> Dict[str, Any]:
    """A row that could not become a request (bad JSON, empty prompt...)."""
    return error_row(item, item.error, time.time(), job_id, config_hash)


def outcome_row(
    request: Request, outcome, started: float, job_id: str, config_hash: str
) -> Dict[str, Any]:
    """The row of one request: its completion, or its error named by the row's place."""
    if not isinstance(outcome, Completion):
        return error_row(
            request,
            f"{request.where}: {type(outcome).__name__}: {outcome}",
            started,
            job_id,
            config_hash,
        )
    s = outcome.stats
    # A batch decodes rows together: a row started when it was handed over, or later when it
    # waited for a free slot (its own prefill and decode time before it finished).
    started = max(started, time.time() - (s.prefill_s + s.decode_s))
    return _row(
        request,
        "ok",
        started,
        job_id,
        config_hash,
        output=outcome.text,
        finish_reason=outcome.finish_reason,
        stop_reason=outcome.stop_reason,
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
        decode_share_s=s.decode_share_s,  # what speculation saved (docs/runner.md)
        plain_seconds_est=s.plain_seconds_est,
        speedup_vs_plain=s.speedup_vs_plain,
        control=s.control,
        logprobs=getattr(outcome, "logprobs", None),
        prompt_token_ids=getattr(outcome, "prompt_token_ids", None),
        token_ids=outcome.token_ids,
    )
