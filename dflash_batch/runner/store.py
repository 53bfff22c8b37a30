"""Result storage: Parquet part files in one output dir, committed atomically, plus a per-item
journal so a killed worker loses at most the item it was generating.

Layout (readers skip names starting with "." or "_", so ``pd.read_parquet(out_dir)`` only ever
sees complete parts)::

    out_dir/part-c00003-1732230000123-4f2a.parquet   committed rows (immutable)
    out_dir/.inflight/c00003-<token>.jsonl            rows finished since the last commit
    out_dir/_manifest.json                            schema version and config hash
    out_dir/.lock                                     see lock.py

The store knows rows and bytes, not tasks or engines.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ..checks import BadValue
from ..files import fsync_dir, write_atomic, write_file_atomic

SCHEMA_VERSION = 1
LOGPROB = pa.field(
    "item", pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])
)
RESULT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),  # "ok" | "error"
        pa.field("output", pa.string()),
        pa.field("finish_reason", pa.string()),  # "stop" | "length" | null on error
        pa.field("stop_reason", pa.string()),  # "eos" or the stop string that ended it
        pa.field("error", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("prefill_s", pa.float64()),
        pa.field("decode_s", pa.float64()),
        pa.field("prefill_tps", pa.float64()),
        pa.field("decode_tps", pa.float64()),
        pa.field("verify_cycles", pa.int64()),
        pa.field("drafted_tokens", pa.int64()),
        pa.field("accepted_tokens", pa.int64()),  # accepted from the draft
        pa.field("acceptance_drafted", pa.float64()),  # accepted / drafted
        pa.field("acceptance_generated", pa.float64()),  # accepted / completion tokens
        pa.field("tokens_per_cycle", pa.float64()),  # committed tokens per verify cycle
        pa.field(
            "acceptance_histogram", pa.list_(pa.int64())
        ),  # [k] = cycles that committed k tokens
        pa.field("block_size", pa.int64()),  # 0: plain autoregressive
        pa.field("peak_memory_gb", pa.float64()),
        # what speculation saved (docs/runner.md); null in parts from before
        pa.field("decode_share_s", pa.float64()),  # the row's share of the decode cycles it rode in
        pa.field(
            "plain_seconds_est", pa.float64()
        ),  # its tokens at a measured plain cycle's share each
        pa.field("speedup_vs_plain", pa.float64()),  # plain_seconds_est / decode_share_s
        pa.field("control", pa.bool_()),  # decoded plainly in the batch, as a check (--control)
        pa.field("started_at", pa.timestamp("us", tz="UTC")),
        pa.field("finished_at", pa.timestamp("us", tz="UTC")),
        pa.field("input_index", pa.int64()),
        pa.field("job_id", pa.string()),
        pa.field("config_hash", pa.string()),
        pa.field("metadata", pa.string()),  # the row's metadata as JSON text
        pa.field(
            "sample_index", pa.int64()
        ),  # which of the row's n samples (null in parts from before n)
        # per output token, when asked: its raw logprob and the top alternatives' (docs/sampling.md)
        pa.field(
            "logprobs",
            pa.list_(
                LOGPROB.with_type(
                    pa.struct(
                        list(LOGPROB.type) + [pa.field("top_logprobs", pa.list_(LOGPROB.type))]
                    )
                )
            ),
        ),
        # what training a drafter on the job needs (training/adapt.py): the prompt as the target
        # read it and the completion, as token ids (the EOS that ended it not among them), and the
        # drafter revision that drafted the row (null: the job's own drafter)
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
        pa.field("token_ids", pa.list_(pa.int32())),
        pa.field("drafter_revision", pa.string()),
    ],
    metadata={"schema_version": str(SCHEMA_VERSION), "producer": "dflash-batch"},
)
TIMESTAMPS = ("started_at", "finished_at")


def row_key(item_id: str, sample_index: Optional[int] = 0):
    """What one result row stands for: the item id (sample 0, and rows from before n), else
    (id, sample index). Every key is written exactly once."""
    return item_id if not sample_index else (item_id, sample_index)


def key_of(row: Dict[str, Any]):
    return row_key(row["id"], row.get("sample_index"))


_ID_CACHE: Dict[str, Dict[str, Any]] = {}  # output dir -> part name -> ((size, mtime_ns), ids)


def to_table(rows: List[Dict[str, Any]]) -> pa.Table:
    """Rows (timestamps as epoch seconds) -> a table with exactly ``RESULT_SCHEMA``."""
    converted = []
    for row in rows:
        row = {name: row.get(name) for name in RESULT_SCHEMA.names}
        for name in TIMESTAMPS:
            if isinstance(row[name], (int, float)):
                row[name] = datetime.fromtimestamp(row[name], tz=timezone.utc)
        converted.append(row)
    return pa.Table.from_pylist(converted, schema=RESULT_SCHEMA)


class Journal:
    """Append-only JSON lines of finished rows for one chunk run, fsynced per row."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: List[Dict[str, Any]] = []
        self._file = None

    def append(self, row: Dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.parent.is_symlink():
                raise BadValue(
                    f"{self.path.parent} is a symlink; refusing to write through it (remove it)"
                )
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            self._file = os.fdopen(fd, "ab")
        self._file.write(orjson.dumps(row) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.rows.append(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_journal(path: Path) -> List[Dict[str, Any]]:
    """Rows of a journal; a torn last line (killed mid-write) is ignored: that item was not
    finished as far as anyone knows, and is generated again."""
    rows = []
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return rows
    for line in data.splitlines():
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            rows.append(row)
    return rows


class ResultStore:
    def __init__(self, out_dir: os.PathLike):
        self.dir = Path(out_dir)
        self.inflight = self.dir / ".inflight"
        self.manifest_path = self.dir / "_manifest.json"

    def ensure(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.inflight.is_symlink():  # journals stay inside the output dir
            raise BadValue(
                f"{self.inflight} is a symlink; refusing to write through it (remove it)"
            )

    # -- parts ----------------------------------------------------------------------------
    def parts(self) -> List[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("part-*.parquet") if p.is_file())

    def write_part(self, rows: List[Dict[str, Any]], chunk: int) -> Optional[Path]:
        """Commit rows as a new part file (atomically); nothing for no rows."""
        if not rows:
            return None
        self.ensure()
        name = f"part-c{chunk:05d}-{int(time.time() * 1000):013d}-{secrets.token_hex(2)}.parquet"
        return write_file_atomic(self.dir / name, lambda tmp: pq.write_table(to_table(rows), tmp))

    def read(self, columns: Optional[List[str]] = None) -> pa.Table:
        """All committed rows (an empty table with the schema when there are none)."""
        parts = self.parts()
        if not parts:
            table = RESULT_SCHEMA.empty_table()
            return table.select(columns) if columns else table
        dataset = ds.dataset([str(p) for p in parts], format="parquet", schema=RESULT_SCHEMA)
        return dataset.to_table(columns=columns)

    def committed_ids(self) -> Set[Any]:
        """Row keys (``row_key``) in committed parts. Each part's ids are read once per process and kept, keyed by
        the file's name, size and mtime (parts are immutable but for ``drop_ids`` rewrites)."""
        cache = _ID_CACHE.setdefault(str(self.dir.resolve()), {})
        seen: Set[str] = set()
        ids: Set[str] = set()
        for path in self.parts():
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            key = (st.st_size, st.st_mtime_ns)
            entry = cache.get(path.name)
            if entry is None or entry[0] != key:
                names = [n for n in ("id", "sample_index") if n in pq.read_schema(path).names]
                rows = pq.read_table(path, columns=names).to_pylist()
                entry = (key, frozenset(key_of(r) for r in rows))
                cache[path.name] = entry
            seen.add(path.name)
            ids |= entry[1]
        for name in set(cache) - seen:
            del cache[name]
        return ids

    # -- journals ---------------------------------------------------------------------------
    def journal(self, chunk: int) -> Journal:
        return Journal(
            self.inflight
            / f"c{chunk:05d}-{int(time.time() * 1000):013d}-{secrets.token_hex(3)}.jsonl"
        )

    def journals(self) -> List[Path]:
        return sorted(self.inflight.glob("*.jsonl")) if self.inflight.is_dir() else []

    def journal_rows(self) -> List[Dict[str, Any]]:
        return [row for path in self.journals() for row in read_journal(path)]

    def commit_journal(self, journal: Journal, chunk: int) -> Optional[Path]:
        """Rows of a live journal -> a part, then drop the journal."""
        journal.close()
        part = self.write_part(journal.rows, chunk)
        journal.path.unlink(missing_ok=True)
        journal.rows = []
        return part

    def recover(self, chunks: Optional[Iterable[int]] = None) -> int:
        """Commit journals left by a dead process (call with the lock held; a queue worker holds
        only its chunks' leases and recovers only ``chunks``' journals). Rows whose id a part
        already has (the process died between the commit and the unlink) are dropped."""
        recovered = 0
        committed = None
        mine = None if chunks is None else {f"c{c:05d}-" for c in chunks}
        for path in self.journals():
            if mine is not None and path.name[:7] not in mine:
                continue
            rows = read_journal(path)
            if rows:
                committed = self.committed_ids() if committed is None else committed
                rows = [r for r in _unique(rows) if key_of(r) not in committed]
                chunk = int(path.name[1:6]) if path.name[1:6].isdigit() else 99999
                self.write_part(rows, chunk)
                committed.update(key_of(r) for r in rows)
                recovered += len(rows)
            path.unlink(missing_ok=True)
        return recovered

    def done_ids(self) -> Set[Any]:
        """Row keys (``row_key``: the id, or (id, sample) for samples past the first) with a
        finished row, committed or journaled: these are never generated again."""
        return self.committed_ids() | {key_of(row) for row in self.journal_rows()}

    def drop_ids(self, ids: Iterable[str]) -> int:
        """Rewrite the parts without rows for ``ids`` (each part replaced atomically); returns
        how many rows went. Used by ``retry --failed-only``."""
        ids = set(ids)
        dropped = 0
        for path in self.parts():
            table = pq.read_table(path, schema=RESULT_SCHEMA)
            keep = pa.array([i not in ids for i in table.column("id").to_pylist()], type=pa.bool_())
            n_keep = sum(keep.to_pylist())
            if n_keep == table.num_rows:
                continue
            dropped += table.num_rows - n_keep
            if n_keep == 0:
                path.unlink()
                continue
            kept = table.filter(keep)
            write_file_atomic(path, lambda tmp: pq.write_table(kept, tmp))
        fsync_dir(self.dir)
        return dropped

    def remove_files(self) -> int:
        """Delete this store's own files (parts, journals, manifest, OpenAI export); returns how
        many. Anything else in the dir stays."""
        own = self.parts() + self.journals()
        own += [self.manifest_path, self.dir / "_openai_output.jsonl"]
        for path in own:
            path.unlink(missing_ok=True)
        return len(own)

    def remove_dir(self) -> bool:
        """Delete the lock file and the dir (after ``remove_files``, with the lock released),
        only if that leaves nothing behind. True if the dir went."""
        (self.dir / ".lock").unlink(missing_ok=True)
        for folder in (self.inflight, self.dir):
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # not empty: files that are not ours
                return False
        return True

    # -- manifest -------------------------------------------------------------------------
    def manifest(self) -> Dict[str, Any]:
        try:
            return orjson.loads(self.manifest_path.read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return {}

    def write_manifest(self, **fields) -> None:
        self.ensure()
        data = dict(
            self.manifest(), schema_version=SCHEMA_VERSION, updated_at=time.time(), **fields
        )
        write_atomic(self.manifest_path, orjson.dumps(data, option=orjson.OPT_INDENT_2))


def _unique(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    seen, out = set(), []
    for row in rows:
        if key_of(row) not in seen:
            seen.add(key_of(row))
            out.append(row)
    return out
