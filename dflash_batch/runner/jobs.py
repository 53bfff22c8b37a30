"""Job records under ``$DFLASH_BATCH_HOME/jobs/<job id>/``, and what ``status`` reports.

A record is a few small files, each written atomically: ``job.json`` (the resolved spec, output
dir, config hash, total rows, chunk count), ``ids.json`` (the input's ids in order), marker files
``cancelled``, ``failed.json``, ``chunk-00003.done``, ``foreground`` (a ``run``'s job: no queue
worker takes its chunks) and, during ``retry --failed-only``, ``retry_ids.json``. Progress
itself lives in the output dir (store.py), never here.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set

import orjson

from .. import checks
from ..errors import AmbiguousJob, JobActive, JobNotFound, OutputDirClaimed
from ..files import write_atomic
from ..paths import home_dir  # noqa: F401  (the name the front ends import from here)
from . import drafters, saved
from .items import read_items
from .lock import is_locked
from .spec import JobSpec, SpecError, default_name
from .store import ResultStore, key_of


def check_home(home: Path, write: bool) -> None:
    """Refuse a home that is not a folder, or, for a command that writes, one where nothing can
    be written (a read-only file system): before any work, rather than a traceback halfway."""
    if home.exists() and not home.is_dir():
        raise SpecError(f"{home} is not a folder")
    if write:
        check_writable_folder(home)


def check_writable_folder(folder: Path) -> None:
    """Refuse (``SpecError`` naming the folder) a folder that cannot be made or written to."""
    if folder.exists() and not folder.is_dir():
        raise SpecError(f"{folder} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _probe_write(folder)
    except OSError as e:
        raise SpecError(f"{folder}: cannot write there ({e.strerror or e})") from None


def check_output_folder(output_dir: Path) -> None:
    """Refuse (``SpecError`` naming ``output_dir``) a job's output folder that cannot be one."""
    try:
        check_writable_folder(output_dir)
    except SpecError as e:
        raise SpecError(f"output_dir {e}") from None


def _probe_write(folder: Path) -> None:
    with tempfile.TemporaryFile(dir=folder):
        pass


def new_job_id(name: str) -> str:
    return f"{checks.slug(name) or 'job'}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


class JobRecord:
    def __init__(self, home: Path, job_id: str):
        self.home = Path(home)
        self.id = job_id
        self.dir = self.home / "jobs" / job_id
        self._data: Optional[Dict[str, Any]] = None
        self.new = False  # made by this create_job call (not an earlier job taken up again)

    # -- stored fields --------------------------------------------------------------------
    @property
    def data(self) -> Dict[str, Any]:
        if self._data is None:
            try:
                self._data = orjson.loads((self.dir / "job.json").read_bytes())
            except FileNotFoundError:
                raise JobNotFound(f"no job {self.id!r} in {self.home / 'jobs'}") from None
        return self._data

    @property
    def spec(self) -> JobSpec:
        return JobSpec.from_dict(self.data["spec"])

    @property
    def output_dir(self) -> Path:
        return Path(self.data["output_dir"])

    @property
    def chunks(self) -> int:
        return self.data["chunks"]

    @property
    def total(self) -> int:
        return self.data["total"]

    def ids(self) -> List[str]:
        return orjson.loads((self.dir / "ids.json").read_bytes())

    def store(self) -> ResultStore:
        return ResultStore(self.output_dir)

    # -- markers ----------------------------------------------------------------------------
    def _marker(self, name: str) -> Path:
        return self.dir / name

    def cancelled(self) -> bool:
        return self._marker("cancelled").exists()

    def failure(self) -> Optional[str]:
        try:
            return orjson.loads(self._marker("failed.json").read_bytes())["error"]
        except (FileNotFoundError, orjson.JSONDecodeError, KeyError):
            return None

    def mark_cancelled(self) -> None:
        write_atomic(self._marker("cancelled"), str(time.time()).encode())

    def mark_failed(self, error: str) -> None:
        write_atomic(self._marker("failed.json"), orjson.dumps({"error": error, "at": time.time()}))

    def foreground(self) -> bool:
        """Is this a foreground ``run``'s job? Only a rerun resumes it, never a queue worker."""
        return self._marker("foreground").exists()

    def mark_chunk_done(self, chunk: int) -> None:
        write_atomic(self._marker(f"chunk-{chunk:05d}.done"), b"")

    def chunk_done(self, chunk: int) -> bool:
        return self._marker(f"chunk-{chunk:05d}.done").exists()

    def pending_chunks(self) -> List[int]:
        return [c for c in range(self.chunks) if not self.chunk_done(c)]

    def retry_ids(self) -> Optional[Set[str]]:
        try:
            return set(orjson.loads(self._marker("retry_ids.json").read_bytes()))
        except FileNotFoundError:
            return None

    def reopen(self, chunks: List[int], retry_ids: Optional[List[str]] = None) -> None:
        """Make the job runnable again by queue workers: clear cancel/failure, the foreground
        mark and the given chunks' markers."""
        for name in ("cancelled", "failed.json", "retry_ids.json", "foreground"):
            self._marker(name).unlink(missing_ok=True)
        if retry_ids is not None:
            write_atomic(self._marker("retry_ids.json"), orjson.dumps(sorted(retry_ids)))
        for c in chunks:
            self._marker(f"chunk-{c:05d}.done").unlink(missing_ok=True)

    def discard(self) -> None:
        """Delete a record that a refused command made (nothing ran under it)."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def chunk_range(self, chunk: int):
        size = self.spec.chunk_size
        return chunk * size, min((chunk + 1) * size, self.total)

    def items(self, chunk: int):
        """The input rows of one chunk, as Items (read from the chunk's recorded file position)."""
        spec = self.spec
        start, end = self.chunk_range(chunk)
        cursors = self.data.get("chunk_cursors") or []
        cursor = tuple(cursors[chunk]) if chunk < len(cursors) and cursors[chunk] else None
        return read_items(
            spec.input, spec.input_format, spec.fields, start=start, stop=end, cursor=cursor
        )

    # -- status ---------------------------------------------------------------------------
    def status(self) -> Dict[str, Any]:
        """Counts and means over this job's ids, as found in the output dir right now."""
        ids = set(self.ids())
        store = self.store()
        table = store.read(["id", "sample_index", "status", "decode_tps", "acceptance_drafted",
                            "acceptance_generated", "tokens_per_cycle"] + saved.COLUMNS)  # fmt: skip
        rows = [r for r in table.to_pylist() if r["id"] in ids]
        seen = {key_of(r) for r in rows}
        rows += [r for r in store.journal_rows() if r["id"] in ids and key_of(r) not in seen]
        ok = [r for r in rows if r["status"] == "ok"]
        failed = len(rows) - len(ok)
        # items with a row (each of an item's n samples has one)
        done = len({r["id"] for r in rows})
        if (
            done >= self.total and not self.pending_chunks()
        ):  # every row, and every chunk's part committed
            state = "completed"
        elif self.cancelled():
            state = "cancelled"
        elif self.failure():
            state = "failed"
        elif is_locked(self.output_dir):
            state = "running"
        elif self.foreground():  # its run stopped (Ctrl-C, kill -9): nothing runs it until a rerun
            state = "interrupted"
        else:
            state = "queued" if done == 0 else "in_progress"

        def mean(key):
            values = [r[key] for r in ok if r.get(key) is not None]
            return sum(values) / len(values) if values else None

        speculation = saved.figures(rows)
        return {
            "id": self.id,
            "name": self.data["name"],
            "state": state,
            "total": self.total,
            "done": done,
            "rows": len(rows),  # result rows: an item with n samples has n
            "ok": len(ok),
            "failed": failed,
            "remaining": self.total - done,
            "completion_tokens": sum(r.get("completion_tokens") or 0 for r in rows),
            "mean_decode_tps": mean("decode_tps"),
            "mean_acceptance_drafted": mean("acceptance_drafted"),
            "mean_acceptance_generated": mean("acceptance_generated"),
            "mean_tokens_per_cycle": mean("tokens_per_cycle"),
            "speedup_vs_plain": speculation["speedup"],  # what speculation saved (runner/saved.py)
            "speculation": speculation,
            "output_dir": str(self.output_dir),
            "config_hash": self.data["config_hash"],
            "created_at": self.data["created_at"],
            "error": self.failure(),
            "drafter": drafters.summary(self),  # adapted drafter revisions (drafters.py)
        }


def counts_text(status: Dict[str, Any]) -> str:
    """A status's counts with their units: items (input rows) done, and the result rows they
    gave (one per sample), ok and failed."""
    rows = status["ok"] + status["failed"]
    return (
        f"{status['done']}/{status['total']} items done; {rows} rows: "
        f"{status['ok']} ok, {status['failed']} failed"
    )


def create_job(
    spec: JobSpec, home: Path, job_id: Optional[str] = None, foreground: bool = False
) -> JobRecord:
    """Validate the input (whole-input problems raise ``InputError``), check the output dir's
    config hash (a different one raises ``OutputDirClaimed``, a ``SpecError``, unless
    ``spec.force``), write the record.
    ``foreground``: a ``run``'s job, which workers leave alone. An earlier job of this very spec,
    output dir and ids is given instead of a new record when it is completed and nothing is left
    to do (a no-op resubmit), or, for a run, when it is a stopped run (the rerun resumes it)."""
    home = Path(home)
    name = spec.name or default_name(spec.input)
    output_dir = spec.resolved_output_dir(home)
    ids, cursors = [], []
    samples = spec.n > 1  # some item has more than one sample (its result rows: one per sample)
    for item in read_items(spec.input, spec.input_format, spec.fields):
        if item.index % spec.chunk_size == 0:
            cursors.append(item.cursor)  # where each chunk starts in the file
        ids.append(item.id)
        samples = samples or item.options.get("n", 1) > 1
    config_hash = spec.config_hash()
    check_output_folder(output_dir)
    store = ResultStore(output_dir)
    check_claim(store, spec)
    chunk_size = spec.chunk_size
    done = store.done_ids()  # rows an earlier job already wrote to this output dir
    # An id's first row says the item is done only when no item has more samples (else the job
    # loop checks each sample of each item).
    done_chunks = [c for c in range(0, len(ids), chunk_size)
                   if not samples and all(i in done for i in ids[c:c + chunk_size])]  # fmt: skip
    chunks = (len(ids) + chunk_size - 1) // chunk_size
    earlier = same_job(home, spec, output_dir, ids, finished=len(done_chunks) == chunks,
                       stopped=foreground)  # fmt: skip
    if earlier is not None:
        return earlier
    store.write_manifest(config_hash=config_hash, name=name)
    record = JobRecord(home, job_id or new_job_id(name))
    record.dir.mkdir(parents=True, exist_ok=False)
    record.new = True
    if foreground:  # before job.json: a worker's reaper never sees the record without it
        write_atomic(record._marker("foreground"), b"")
    write_atomic(record.dir / "ids.json", orjson.dumps(ids))
    data = {
        "id": record.id,
        "name": name,
        "spec": spec.to_dict(),
        "output_dir": str(output_dir),
        "config_hash": config_hash,
        "total": len(ids),
        "chunks": chunks,
        "chunk_cursors": cursors,
        "created_at": time.time(),
    }
    write_atomic(record.dir / "job.json", orjson.dumps(data, option=orjson.OPT_INDENT_2))
    for start in done_chunks:
        record.mark_chunk_done(start // chunk_size)
    return record


def check_claim(store: ResultStore, spec: JobSpec) -> None:
    """Refuse (``OutputDirClaimed``) an output dir holding results of another config, unless
    ``spec.force``."""
    previous, config_hash = store.manifest().get("config_hash"), spec.config_hash()
    if previous and previous != config_hash and not spec.force:
        claimed = (f"{store.dir} holds results made with another model/sampling config "
                   f"(hash {previous}, now {config_hash})")  # fmt: skip
        raise OutputDirClaimed(
            f"{claimed}; use another output_dir= (or name=, where the folder is named after "
            "the job), or force=True to add to it anyway",
            f"{claimed}; use another -o/--output-dir (or --name, where the folder is named after "
            "the job), or --force to add to it anyway",
        )


def same_job(
    home: Path, spec: JobSpec, output_dir: Path, ids: List[str], finished: bool, stopped: bool
) -> Optional[JobRecord]:
    """The latest job with this very spec, output dir and ids that is completed (if
    ``finished``) or a foreground run that stopped with work left (if ``stopped``)."""
    wanted = spec.to_dict()
    for record in reversed(list_jobs(home)):
        if record.data["spec"] != wanted or record.output_dir != output_dir:
            continue
        if record.cancelled() or record.failure():
            continue
        pending = record.pending_chunks()
        resumable = stopped and pending and record.foreground() and not is_locked(output_dir)
        if ((finished and not pending) or resumable) and record.ids() == ids:
            return record
    return None


def load_job(home: Path, job_id: str) -> JobRecord:
    """A job by id, or by a unique prefix of its id (a plain name: never a path)."""
    try:
        checks.path_under(Path(home) / "jobs", job_id)
    except checks.BadValue as e:
        raise JobNotFound(f"{job_id!r} is not a job id: {e}") from None
    record = JobRecord(home, job_id)
    if (record.dir / "job.json").exists():
        return record
    jobs_dir = Path(home) / "jobs"
    matches = (
        [p.name for p in jobs_dir.glob(f"{glob_escape(job_id)}*") if (p / "job.json").exists()]
        if jobs_dir.is_dir()
        else []
    )
    if len(matches) == 1:
        return JobRecord(home, matches[0])
    if len(matches) > 1:
        raise AmbiguousJob(f"{job_id!r} is the start of {len(matches)} job ids; give one in full "
                           f"(or more of it): {', '.join(sorted(matches))}")  # fmt: skip
    raise JobNotFound(f"no job {job_id!r} in {jobs_dir} (see `dflash-batch status`)")


REMOVABLE = ("completed", "failed", "cancelled", "interrupted")  # nothing will run these on its own


def check_removable(record: JobRecord) -> None:
    """Refuse (``JobActive``) a job that is queued or running: it is cancelled first."""
    state = record.status()["state"]
    if state not in REMOVABLE:
        raise JobActive(f"job {record.id} is {state}: only finished jobs ({', '.join(REMOVABLE)}) "
                        f"are removed; `dflash-batch cancel {record.id}` first")  # fmt: skip


def remove_job(
    record: JobRecord, files: bool = False, going: Set[str] = frozenset()
) -> Optional[str]:
    """Delete a finished job's record; with ``files``, also its output dir's result files,
    unless the record of another job (not among ``going``, removed with it) names that dir.
    Returns why files were kept, if some were. The caller has checked it (``check_removable``)."""
    from .lock import DirLock

    kept = None
    if files:
        others = [r.id for r in list_jobs(record.home) if r.id != record.id and r.id not in going
                  and r.output_dir == record.output_dir]  # fmt: skip
        if others:
            kept = f"{record.output_dir} kept: job(s) {', '.join(others)} write there too"
        elif record.output_dir.is_dir():
            store = record.store()
            with DirLock(record.output_dir):  # no process writes while its parts go
                store.remove_files()
            if not store.remove_dir():
                kept = f"{record.output_dir} kept: its results went, files of other kinds stay"
    shutil.rmtree(record.dir)
    return kept


def prunable(home: Path, older_than: float, now: float) -> List[JobRecord]:
    """Finished jobs created more than ``older_than`` seconds before ``now``."""
    old = [r for r in list_jobs(home) if r.data["created_at"] < now - older_than]
    return [r for r in old if r.status()["state"] in REMOVABLE]


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def list_jobs(home: Path) -> List[JobRecord]:
    jobs_dir = Path(home) / "jobs"
    if not jobs_dir.is_dir():
        return []
    records = [JobRecord(home, p.name) for p in jobs_dir.iterdir() if (p / "job.json").exists()]
    return sorted(records, key=lambda r: r.data["created_at"])
