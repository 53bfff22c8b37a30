"""Batches of the Batches API, each a job of the runner, under ``<home>/serve/batches/<id>/``:
``batch.json`` (the OpenAI batch object and the job's id) and ``input.jsonl`` (the input as it
was when the batch was made, so deleting the uploaded file changes nothing).

A batch's status follows its job's state, read afresh on every look: queued or running ->
``in_progress``; completed -> ``finalizing`` while the output and error files are written, then
``completed``; cancelled -> ``cancelling`` while a worker still holds the output dir, then
``cancelled``; past ``expires_at`` (by the injectable clock) the job is cancelled and ends
``expired``, its unfinished requests in the error file as ``batch_expired``.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import orjson

from ..errors import InputError, SetupError
from ..files import write_atomic
from ..runner.export import openai_samples
from ..runner.items import OPENAI_URLS
from ..runner.jobs import JobNotFound, JobRecord, load_job
from ..runner.lock import is_locked
from ..runner.spec import SpecError
from .errors import bad_request, not_found
from .files import FileStore, new_id

BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
WINDOWS = {"24h": 24 * 3600}
FINAL = ("completed", "failed", "cancelled", "expired")
MAX_METADATA = 16  # OpenAI's: pairs, keys of at most 64 characters, values of at most 512
EXTENSION = "dflash"  # the key of this server's own fields in OpenAI objects
Submit = Callable[..., Any]  # api.submit's signature: (input, *, home, **overrides) -> Job


class Batches:
    def __init__(
        self,
        home: Path,
        files: FileStore,
        submit: Submit,
        overrides: Optional[Dict[str, Any]] = None,
        clock: Callable[[], float] = time.time,
    ):
        self.home = Path(home)
        self.root = self.home / "serve" / "batches"
        self.files = files
        self.submit = submit
        self.overrides = dict(overrides or {})
        self.clock = clock
        self.lock = threading.RLock()  # one request at a time moves a batch's state

    # -- the API ---------------------------------------------------------------------------
    def create(self, body: Any) -> Dict[str, Any]:
        params = _create_params(body)
        source = self.files.record(params["input_file_id"])
        if source["object"]["purpose"] != "batch":
            raise bad_request(f"file {params['input_file_id']} has purpose "
                              f"{source['object']['purpose']!r}, not 'batch'",
                              "input_file_id", "invalid_purpose")  # fmt: skip
        created = self.clock()
        now = int(created)
        batch_id = new_id("batch_")
        folder = self.root / batch_id
        folder.mkdir(parents=True)
        _link_or_copy(self.files.content(params["input_file_id"]), folder / "input.jsonl")
        batch = {
            "id": batch_id, "object": "batch", "endpoint": params["endpoint"], "errors": None,
            "input_file_id": params["input_file_id"], "completion_window": params["window"],
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": now, "in_progress_at": None,
            "expires_at": now + WINDOWS[params["window"]], "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "model": None, "metadata": params["metadata"],
            "request_counts": {"total": source.get("requests", 0), "completed": 0, "failed": 0},
            EXTENSION: {"job_id": None, "created": created},  # orders batches made in one second
        }  # fmt: skip
        with self.lock:
            self._save(batch)
            try:
                self._start(batch, source, folder / "input.jsonl")
            except Exception as e:  # never left validating: the batch says what went wrong
                self._fail(batch, "server_error", f"{type(e).__name__}: {e}")
                self._save(batch)
                raise
            return self._save(batch)

    def get(self, batch_id: str) -> Dict[str, Any]:
        with self.lock:
            return self._refresh(self._load(batch_id))

    def list(
        self, after: Optional[str] = None, limit: int = 20
    ) -> Tuple[List[Dict[str, Any]], bool]:
        """A page of batches, newest first, after the batch ``after``; and whether more follow."""
        with self.lock:
            batches = sorted(self._all(), key=lambda b: (b[EXTENSION]["created"], b["id"]),
                             reverse=True)  # fmt: skip
            if after is not None:
                ids = [b["id"] for b in batches]
                if after not in ids:
                    raise bad_request(f"after: no batch {after!r}", "after", "invalid_cursor")
                batches = batches[ids.index(after) + 1 :]
            page = [self._refresh(b) for b in batches[:limit]]
            return page, len(batches) > limit

    def cancel(self, batch_id: str) -> Dict[str, Any]:
        with self.lock:
            batch = self._refresh(self._load(batch_id))
            if batch["status"] in FINAL or batch["status"] == "cancelling":
                if batch["status"] in ("cancelling", "cancelled"):
                    return batch
                raise bad_request(
                    f"batch {batch_id} is {batch['status']}: only a batch in "
                    "progress can be cancelled",
                    "batch_id",
                    "invalid_state",
                )
            self._job(batch).mark_cancelled()
            batch["status"], batch["cancelling_at"] = "cancelling", int(self.clock())
            return self._refresh(self._save(batch))

    def refreshed(self) -> List[Dict[str, Any]]:
        """Every batch that has a job, each at its status now."""
        with self.lock:
            return [self._refresh(b) for b in self._all() if b[EXTENSION]["job_id"]]

    # -- lifecycle -------------------------------------------------------------------------
    def _start(self, batch: Dict[str, Any], source: Dict[str, Any], path: Path) -> None:
        """Validate the input against the batch as a whole and queue its job: ``failed`` with
        ``errors`` for an input that cannot run, else ``in_progress``."""
        others = sorted(set(source.get("urls", [])) - {batch["endpoint"]})
        if others:
            self._fail(batch, "mismatched_endpoint",
                       f"the input has requests for {', '.join(others)}; this batch's endpoint "
                       f"is {batch['endpoint']}: every request must use it")  # fmt: skip
            return
        try:
            job = self.submit(path, home=self.home, input_format="openai", name=batch["id"],
                              **self.overrides)  # fmt: skip
        except (InputError, SpecError, SetupError) as e:
            self._fail(batch, "invalid_input", str(e))
            return
        batch[EXTENSION]["job_id"] = job.id
        batch["model"] = job.record.spec.model_name
        batch["status"], batch["in_progress_at"] = "in_progress", int(self.clock())

    def _fail(self, batch: Dict[str, Any], code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        batch["errors"] = {"object": "list", "data": [error]}
        batch["status"], batch["failed_at"] = "failed", int(self.clock())

    def _refresh(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """The batch with the status its job's state gives it now (saved when it moved)."""
        if batch["status"] in FINAL or batch["status"] == "validating":
            return batch
        try:
            record = self._job(batch)
            state = record.status()
        except (JobNotFound, OSError) as e:  # the job's record or results went (`rm`)
            self._fail(batch, "job_gone", f"the batch's job cannot be read: {e}")
            return self._save(batch)
        batch["request_counts"] = request_counts(record)
        now = int(self.clock())
        expiring = batch[EXTENSION].get("expiring", False)
        if state["state"] != "completed" and now >= batch["expires_at"] and not expiring:
            record.mark_cancelled()  # what finished is kept; the rest is reported expired
            batch[EXTENSION]["expiring"] = expiring = True
        if state["state"] == "completed":
            self._finalize(batch, record, "completed")
        elif state["state"] == "failed":
            self._finalize(batch, record, "failed")
            batch["errors"] = {
                "object": "list",
                "data": [
                    {"code": "job_failed", "message": state["error"], "param": None, "line": None}
                ],
            }
        elif record.cancelled() or expiring:
            if is_locked(record.output_dir):  # a worker still finishes its current item
                if batch["status"] != "cancelling" and not expiring:
                    batch["status"], batch["cancelling_at"] = "cancelling", now
            else:
                self._finalize(batch, record, "expired" if expiring else "cancelled")
        return self._save(batch)

    def _finalize(self, batch: Dict[str, Any], record: JobRecord, status: str) -> None:
        """Write the output and error files of what finished, then end in ``status``."""
        batch["status"], batch["finalizing_at"] = "finalizing", int(self.clock())
        self._save(batch)
        expired = status == "expired"
        output, errors = output_lines(record, batch["model"], expired)
        if output:
            name = f"{batch['id']}_output.jsonl"
            batch["output_file_id"] = self.files.add(b"".join(output), name)["id"]
        if errors:
            name = f"{batch['id']}_error.jsonl"
            batch["error_file_id"] = self.files.add(b"".join(errors), name)["id"]
        counts = request_counts(record)
        if expired:  # the requests that never ran are in the error file
            counts["failed"] = counts["total"] - counts["completed"]
        batch["request_counts"] = counts
        batch["status"], batch[f"{status}_at"] = status, int(self.clock())

    # -- storage -----------------------------------------------------------------------------
    def _job(self, batch: Dict[str, Any]) -> JobRecord:
        return load_job(self.home, batch[EXTENSION]["job_id"])

    def _load(self, batch_id: str) -> Dict[str, Any]:
        if not isinstance(batch_id, str) or not BATCH_ID.fullmatch(batch_id):
            raise not_found(
                f"no batch {batch_id!r}: batch ids look like batch_<24 hex digits>", "batch_id"
            )
        path = self.root / batch_id / "batch.json"
        if not path.is_file():
            raise not_found(f"no batch {batch_id!r}", "batch_id")
        return orjson.loads(path.read_bytes())

    def _all(self) -> List[Dict[str, Any]]:
        if not self.root.is_dir():
            return []
        paths = [p / "batch.json" for p in self.root.iterdir() if BATCH_ID.fullmatch(p.name)]
        return [orjson.loads(p.read_bytes()) for p in paths if p.is_file()]

    def _save(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        write_atomic(self.root / batch["id"] / "batch.json", orjson.dumps(batch))
        return batch


def _create_params(body: Any) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise bad_request(
            "input_file_id is required: the id of a file uploaded with purpose 'batch'",
            "input_file_id",
            "missing_required_parameter",
        )
    endpoint = body.get("endpoint")
    if endpoint not in OPENAI_URLS:
        use = " or ".join(sorted(OPENAI_URLS))
        raise bad_request(
            f"endpoint {endpoint!r} is not supported here: use {use}",
            "endpoint",
            "unsupported_endpoint",
        )
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise bad_request(
            f"completion_window {window!r} is not supported: use '24h'",
            "completion_window",
            "invalid_completion_window",
        )
    return {
        "input_file_id": file_id,
        "endpoint": endpoint,
        "window": window,
        "metadata": _metadata(body.get("metadata")),
    }


def _metadata(value: Any) -> Optional[Dict[str, str]]:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in value.items())  # fmt: skip
    if not ok:
        raise bad_request(f"metadata must be an object of at most {MAX_METADATA} string pairs "
                          "(keys of at most 64 characters, values of at most 512)", "metadata",
                          "invalid_metadata")  # fmt: skip
    return value


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)


def _job_rows(record: JobRecord) -> List[Dict[str, Any]]:
    """The job's result rows, committed and journaled, one per sample."""
    from ..runner.store import key_of

    ids = set(record.ids())
    store = record.store()
    rows = [r for r in store.read().to_pylist() if r["id"] in ids]
    seen = {key_of(r) for r in rows}
    return rows + [r for r in store.journal_rows() if r["id"] in ids and key_of(r) not in seen]


def request_counts(record: JobRecord) -> Dict[str, int]:
    """OpenAI's request counts: requests (items) all of whose samples are ok, and requests
    with an error."""
    ids = set(record.ids())
    store = record.store()
    rows = [r for r in store.read(["id", "sample_index", "status"]).to_pylist() if r["id"] in ids]
    rows += [r for r in store.journal_rows() if r["id"] in ids]
    failed = {r["id"] for r in rows if r["status"] != "ok"}
    done = {r["id"] for r in rows}
    return {"total": record.total, "completed": len(done - failed), "failed": len(failed)}


def output_lines(
    record: JobRecord, model: Optional[str], expired: bool = False
) -> Tuple[List[bytes], List[bytes]]:
    """(output lines, error lines) in input order: a request whose samples are all ok goes to
    the output file with its DFlash statistics under ``body["dflash"]``, one with an error to
    the error file; with ``expired``, a request that never ran too, as ``batch_expired``."""
    by_id: Dict[str, List[Dict[str, Any]]] = {}
    for row in _job_rows(record):
        by_id.setdefault(row["id"], []).append(row)
    output, errors = [], []
    for item_id in record.ids():
        rows = by_id.get(item_id)
        if rows is None:
            if expired:
                errors.append(_line(expired_line(item_id)))
            continue
        line = openai_samples(rows, model)
        if line["error"] is None:
            line["response"]["body"][EXTENSION] = dflash_stats(rows)
            output.append(_line(line))
        else:
            errors.append(_line(line))
    return output, errors


def expired_line(item_id: str) -> Dict[str, Any]:
    message = "the batch's completion window passed before this request ran"
    return {
        "id": f"batch_req_{item_id}",
        "custom_id": item_id,
        "response": None,
        "error": {"code": "batch_expired", "message": message},
    }


def dflash_stats(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One request's speculative decoding figures, over its samples: acceptance, tokens per
    verify cycle, decode tok/s, and the target forward passes speculation saved (tokens
    decoded beyond the first, less the verify cycles that committed them)."""

    def total(key):
        return sum(r.get(key) or 0 for r in rows)

    tokens, cycles = total("completion_tokens"), total("verify_cycles")
    drafted, accepted = total("drafted_tokens"), total("accepted_tokens")
    rates = [r["decode_tps"] for r in rows if r.get("decode_tps") is not None]
    speculative = any(r.get("block_size") for r in rows)
    return {
        "block_size": max(r.get("block_size") or 0 for r in rows),
        "verify_cycles": cycles,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_drafted": accepted / drafted if drafted else None,
        "acceptance_generated": accepted / tokens if tokens else None,
        "tokens_per_cycle": tokens / cycles if cycles else None,
        "decode_tps": sum(rates) / len(rates) if rates else None,
        "target_passes_saved": max(tokens - len(rows) - cycles, 0) if speculative else 0,
        "acceptance_histogram": _summed([r.get("acceptance_histogram") or [] for r in rows]),
    }


def _summed(lists: List[List[int]]) -> List[int]:
    out = [0] * max((len(h) for h in lists), default=0)
    for h in lists:
        for k, v in enumerate(h):
            out[k] += v
    return out


def _line(obj: Dict[str, Any]) -> bytes:
    return orjson.dumps(obj, default=str) + b"\n"
