"""Python API of the batch runner, for other apps.

    import dflash_batch
    job = dflash_batch.submit("prompts.jsonl", max_tokens=128)   # queued; a worker runs it
    job.wait(timeout=600)
    df = job.to_pandas()

    job = dflash_batch.run("jobs/dataset.yaml", engine=my_engine)  # in this process, no queue

An engine is any ``dflash_batch.request.CompletionEngine`` (``Engine`` from ``dflash_batch.engine``
is one).

Keyword overrides use the flat spec names (``target``, ``draft``, ``max_tokens``, ``temperature``,
``seed``, ``stop``, ``system_prompt``, ``output_dir``, ``chunk_size``...; see ``JobSpec``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import orjson

from . import checks, environment
from .errors import JobFailed, SettingError
from .files import write_atomic
from .runner import drafters
from .runner.execution import finish_job, run_job
from .runner.jobs import JobRecord, check_output_folder, create_job, home_dir, load_job
from .runner.lock import DirLock, Locked
from .runner.spec import JobSpec, SpecError, load_spec, validate

Source = Union[str, Path, Dict[str, Any]]
FINAL_STATES = ("completed", "cancelled", "failed")
log = logging.getLogger("dflash_batch")


ENGINE_ENV = "DFLASH_BATCH_ENGINE"


def load_model(**model):
    """The default engine factory: ``dflash_batch.engine.load_engine`` (MLX is imported here,
    lazily, and only by whoever calls it). ``$DFLASH_BATCH_ENGINE=module:callable`` names
    another factory (called with the same model keywords; it must return a
    ``request.CompletionEngine``): for another engine, or the tests' fake one."""
    factory = _named_factory()
    if factory is not None:
        return factory(**model)
    from .engine import load_engine

    return load_engine(**model)


def _named_factory() -> Optional[Callable[..., Any]]:
    """The factory $DFLASH_BATCH_ENGINE names, if set."""
    name = environment.get(ENGINE_ENV)
    if not name:
        return None
    import importlib

    module, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr or "load_engine")
    except (ImportError, AttributeError, ValueError) as e:
        raise SettingError(f"${ENGINE_ENV}={name!r} names no engine factory: {e}") from None
    if not callable(factory):
        raise SettingError(f"${ENGINE_ENV}={name!r} names {type(factory).__name__}, not a factory")
    return factory


def check_engine_settings() -> None:
    """Refuse (``SettingError``) the engine's environment variables with a value it cannot use,
    before a job starts; when $DFLASH_BATCH_ENGINE names another engine, that it names one."""
    if _named_factory() is not None:
        return
    environment.check(environment.group("engine"))


class Job:
    """A submitted or finished job: its id, live status and results."""

    def __init__(self, job_id: str, home: Optional[Union[str, Path]] = None):
        self.home = Path(home) if home else home_dir()
        self.record: JobRecord = load_job(self.home, job_id)
        self.id = self.record.id

    def __repr__(self) -> str:
        from .runner.jobs import counts_text

        try:
            status = self.status()
        except Exception:  # a repr must not raise, even for an output dir gone or unreadable
            return f"Job({self.id!r})"
        return f"Job({self.id!r}, {status['state']}: {counts_text(status)})"

    @property
    def output_dir(self) -> Path:
        return self.record.output_dir

    def status(self) -> Dict[str, Any]:
        """``{"state", "total", "done", "rows", "ok", "failed", "mean_decode_tps", ...}``: ``total``
        and ``done`` count items (input rows); ``rows``, ``ok`` and ``failed`` count result rows
        (one per sample: an item with ``n: 2`` gives two)."""
        return self.record.status()

    def speculation(self) -> Dict[str, Any]:
        """What speculation saved on this job so far (``runner/saved.py``; docs/runner.md):
        ``speedup`` (plain decoding's estimated time over the decode time, on the drafted rows),
        ``decode_s``, ``plain_s_est``, the rates, and the control rows' measured rate."""
        return self.status()["speculation"]

    def wait(self, timeout: Optional[float] = None, poll: float = 0.5) -> Dict[str, Any]:
        """Block until the job is completed, cancelled or failed; ``TimeoutError`` after ``timeout``
        s. Both the first poll (logged) and the timeout say so when no worker serves the queue."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first = True
        while True:
            status = self.status()
            if status["state"] in FINAL_STATES:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                note = idle_note(self.record, status["state"])
                still = f"job {self.id} still {status['state']} after {timeout}s"
                counts = f"({status['done']}/{status['total']} done)"
                raise TimeoutError(f"{still} {counts}" + (f": {note}" if note else ""))
            note = idle_note(self.record, status["state"]) if first else None
            if note:
                log.warning("%s", note)
            first = False
            time.sleep(poll)

    def to_arrow(self):
        """This job's rows (one per input id, in no particular order) as a pyarrow Table."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = self.record.store().read()
        return table.filter(
            pc.is_in(table.column("id"), value_set=pa.array(self.record.ids(), pa.string()))
        )

    def to_pandas(self):
        return self.to_arrow().to_pandas()

    def cancel(self) -> None:
        cancel(self.id, home=self.home)


def _spec(source: Union[Source, JobSpec], overrides: Dict[str, Any]) -> JobSpec:
    if isinstance(source, JobSpec):
        return validate(
            JobSpec.from_dict(
                dict(source.to_dict(), **{k: v for k, v in overrides.items() if v is not None})
            )
        )
    return load_spec(source, **overrides)


def submit(
    input: Source,
    *,
    home: Optional[Union[str, Path]] = None,
    redis_url: Optional[str] = None,
    **overrides,
) -> Job:
    """Create a job from a YAML spec, a JSONL/Parquet file or a spec dict, and queue its chunks
    for a worker (``dflash-batch worker``): on SQLite in the home, or on Redis at ``redis_url``
    (default: $DFLASH_BATCH_REDIS_URL). Raises ``InputError``/``SpecError`` for bad input."""
    from .runner.queue import Queue
    from .runner.scaleout import check_output_dir

    home = Path(home) if home else home_dir()
    spec = _spec(input, overrides)
    check_output_dir(spec, home)
    queue = Queue(home, redis_url=redis_url)  # an unusable queue refuses before any record
    record = create_job(spec, home)
    if record.pending_chunks():
        queue.enqueue_job(record)
    else:  # every row is in the output dir already: nothing to queue
        finish_job(record)
    return Job(record.id, home)


def run(
    input: Source,
    *,
    engine: Any = None,
    engine_factory: Optional[Callable[..., Any]] = None,
    home: Optional[Union[str, Path]] = None,
    progress: bool = False,
    **overrides,
) -> Job:
    """Run a job to the end in this process, without the queue. ``engine``: an engine object to
    use as it is; else ``engine_factory(**spec.model)`` (default: ``load_model``). A rerun with
    the same output dir skips the items already done. Raises ``lock.Locked`` when another process
    is working on the output dir, and ``JobFailed`` (the job marked failed) for a job-level error."""
    from .runner.worker import EngineSlot

    home = Path(home) if home else home_dir()
    spec = _spec(input, overrides)
    if engine is None and engine_factory is None:
        check_engine_settings()
    output_dir = spec.resolved_output_dir(home)
    check_output_folder(output_dir)  # before the lock makes it
    with DirLock(output_dir):  # a busy dir refuses before anything is written
        pass
    record = create_job(spec, home, foreground=True)
    engines = (
        (lambda spec: engine) if engine is not None else EngineSlot(engine_factory or load_model)
    )
    bar = None
    if progress:
        from .runner.progress import Progress

        status = record.status()
        bar = Progress(record.total, status["done"], record.id, tokens=status["completion_tokens"])
    try:
        if not record.pending_chunks():
            finish_job(record)
        else:  # the whole job as one stream of requests through the engine
            # the job's adapted drafter in force, if any (runner/drafters.py), as a worker does
            run_job(
                record,
                None,
                lambda spec: drafters.use_in_force(engines(spec), record),
                on_row=bar.row if bar else None,
            )
    except (Locked, checks.BadValue):  # refused before any work: no record is left of it
        if record.new:
            record.discard()
        raise
    except Exception as e:  # as a worker does: the job is failed, its finished rows stay
        record.mark_failed(f"{type(e).__name__}: {e}")
        raise JobFailed(f"job {record.id} failed: {type(e).__name__}: {e}") from e
    finally:
        if bar is not None:
            bar.close()
    return Job(record.id, home)


def dry_run(
    input: Source, *, home: Optional[Union[str, Path]] = None, **overrides
) -> Dict[str, Any]:
    """What ``run`` or ``submit`` would do, without doing it: the input read and its rows and
    error rows counted, the resolved settings, the output folder and the rows already there.
    Loads no model and writes nothing; raises what they would raise for bad input or spec."""
    from .runner.items import count_rows
    from .runner.jobs import check_claim
    from .runner.store import ResultStore

    home = Path(home) if home else home_dir()
    spec = _spec(input, overrides)
    rows, errors = count_rows(spec.input, spec.input_format, spec.fields)
    store = ResultStore(spec.resolved_output_dir(home))
    check_claim(store, spec)
    return {
        "input": spec.input,
        "rows": rows,
        "errors": errors,
        "output_dir": str(store.dir),
        "done": len(store.done_ids()),
        "model": spec.model_name,
        "settings": spec.to_dict(),
    }


def cancel(job_id: str, *, home: Optional[Union[str, Path]] = None) -> Job:
    """Stop a job: queued chunks are dropped when they come up, a running chunk stops between
    items (its finished items stay)."""
    job = Job(job_id, home)
    job.record.mark_cancelled()
    return job


def retry(
    job_id: str,
    *,
    failed_only: bool = False,
    home: Optional[Union[str, Path]] = None,
    redis_url: Optional[str] = None,
) -> Dict[str, int]:
    """Queue a job again (on the queue ``submit`` would use). Error rows are removed and
    generated anew; without ``failed_only`` the items never finished (cancelled, failed job)
    run too. Raises ``lock.Locked`` while a worker is on the job."""
    from .runner.queue import Queue

    job = Job(job_id, home)
    record = job.record
    queue = Queue(job.home, redis_url=redis_url)  # reachable, before the job is changed
    store = record.store()
    ids = record.ids()
    size = record.spec.chunk_size
    with DirLock(record.output_dir):
        store.ensure()
        store.recover()
        rows = store.read(["id", "status"]).to_pylist()
        wanted = set(ids)
        failed = {r["id"] for r in rows if r["status"] != "ok" and r["id"] in wanted}
        ok = {r["id"] for r in rows if r["status"] == "ok"}
        store.drop_ids(failed)
        redo = failed if failed_only else {i for i in ids if i not in ok}
        chunks = sorted({n // size for n, i in enumerate(ids) if i in redo})
        record.reopen(chunks, retry_ids=sorted(failed) if failed_only else None)
    queued = queue.enqueue_job(record, chunks) if chunks else 0
    return {"failed_dropped": len(failed), "items": len(redo), "chunks": queued}


def add_schedule(
    spec_file: Union[str, Path], *, home: Optional[Union[str, Path]] = None, **overrides
) -> Path:
    """Register a YAML job with a ``schedule`` for every worker on this home (copied, with its
    paths made absolute, to ``$DFLASH_BATCH_HOME/schedules/<name>.yaml``; workers read it at
    start). ``overrides`` (flat spec names, as for ``submit``) apply to the copy, which records
    them."""
    import yaml

    overrides = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(overrides.get("output_dir"), str):
        overrides["output_dir"] = _absolute_output_dir(overrides["output_dir"])
    spec = load_spec(spec_file, **overrides)
    if not spec.schedule:
        raise SpecError(f"{spec_file}: no 'schedule' key; use submit to run it once")
    home = Path(home) if home else home_dir()
    name = spec.name or Path(spec_file).stem
    try:
        target = checks.path_under(home / "schedules", f"{checks.plain_name(name)}.yaml")
    except checks.BadValue as e:
        raise SpecError(
            f"{spec_file}: cannot be registered as schedule {name!r}: {e}; give it a 'name'"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    header = f"# registered from {Path(spec_file).resolve()}\n"
    if overrides:
        header += OVERRIDES_LINE + orjson.dumps(overrides, default=str).decode() + "\n"
    write_atomic(target, header + yaml.safe_dump(spec_layout(spec), sort_keys=False))
    return target


# How a registered schedule records the overrides it was registered with (``schedules`` shows).
OVERRIDES_LINE = "# overrides: "


def _absolute_output_dir(text: str) -> str:
    """An output_dir given with the command, made absolute against this directory: a worker
    resolves the registered one from its own."""
    if text.startswith("{home}") or Path(text).expanduser().is_absolute():
        return text
    return str(Path.cwd() / text)


def registered_overrides(path: Path) -> Dict[str, Any]:
    """The overrides recorded in a registered schedule's header ({} if none)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            if line.startswith(OVERRIDES_LINE):
                return orjson.loads(line[len(OVERRIDES_LINE) :])
    return {}


def schedules(home: Optional[Union[str, Path]] = None) -> List[Dict[str, Any]]:
    """The schedules registered in the home: name (what ``remove_schedule`` takes), cron
    expression, input, output_dir, last and next run (UTC, ISO text), the overrides it was
    registered with, file; ``error`` for an unreadable one."""
    from .runner.cron import last_run_path, next_due, utcnow

    home = Path(home) if home else home_dir()
    folder = home / "schedules"
    out = []
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        entry: Dict[str, Any] = {"name": path.stem, "file": str(path)}
        try:
            spec = load_spec(path)
            state = last_run_path(home, path)
        except SpecError as e:
            out.append(dict(entry, error=str(e)))
            continue
        ran = state.read_text().strip() if state.exists() else None
        due = next_due(spec.schedule, utcnow()) if spec.schedule else None
        out.append(dict(entry, schedule=spec.schedule, input=spec.input, catch_up=spec.catch_up, last_run=ran,
                        next_run=due.isoformat(timespec="minutes") if due else None,
                        output_dir=spec.output_dir,
                        overrides=registered_overrides(path)))  # fmt: skip
    return out


def remove_schedule(name: str, *, home: Optional[Union[str, Path]] = None) -> Path:
    """Delete a registered schedule and its last-run record; returns the file removed. Running
    workers keep the schedule until they restart. Raises ``ScheduleNotFound``."""
    from .runner.cron import ScheduleNotFound, last_run_path

    home = Path(home) if home else home_dir()
    try:
        path = checks.path_under(home / "schedules", f"{checks.plain_name(name)}.yaml")
    except checks.BadValue as e:
        raise ScheduleNotFound(f"{name!r} is not a schedule name: {e}") from None
    if not path.is_file():
        raise ScheduleNotFound(
            f"no schedule {name!r} in {path.parent} (see `dflash-batch schedules`)"
        )
    last_run_path(home, path).unlink(missing_ok=True)
    path.unlink()
    return path


def spec_layout(spec: JobSpec) -> Dict[str, Any]:
    """A spec in the YAML layout (model and sampling sections), paths absolute."""
    from .runner.spec import MODEL_KEYS, SAMPLING_KEYS

    flat = spec.to_dict()
    out: Dict[str, Any] = {k: v for k, v in flat.items() if k not in MODEL_KEYS + SAMPLING_KEYS}
    out["model"] = {k: flat[k] for k in MODEL_KEYS}
    out["sampling"] = {k: flat[k] for k in SAMPLING_KEYS}
    return out


def activity(
    home: Optional[Union[str, Path]] = None, redis_url: Optional[str] = None
) -> Dict[str, Any]:
    """Who works on what, from the queue's store: ``{"workers": [{id, host, device, chunk,
    rows_per_s, tokens_per_s, ...}], "leases": [{job, chunk, worker, expires_in}]}`` (empty when
    the home has no queue yet)."""
    from .runner.lease import Leases
    from .runner.queue import REDIS_ENV, Queue

    home = Path(home) if home else home_dir()
    if not (redis_url or environment.get(REDIS_ENV)) and not (home / "queue.db").exists():
        return {"workers": [], "leases": []}
    leases = Leases(Queue(home, redis_url=redis_url).huey.storage)
    now = time.time()
    held = [dict(r, expires_in=round(r["expires"] - now, 1)) for r in leases.leases()]
    return {
        "workers": leases.workers(),
        "leases": sorted(held, key=lambda r: (r["job"], r["chunk"])),
    }


def live_workers(
    home: Optional[Union[str, Path]] = None,
    redis_url: Optional[str] = None,
    clock: Callable[[], float] = time.time,
) -> List[Dict[str, Any]]:
    """The workers of the home's queue whose heartbeat is recent (their records, by id)."""
    from .runner.lease import Leases
    from .runner.queue import REDIS_ENV, Queue

    home = Path(home) if home else home_dir()
    if not (redis_url or environment.get(REDIS_ENV)) and not (home / "queue.db").exists():
        return []
    return Leases(Queue(home, redis_url=redis_url).huey.storage, clock=clock).workers()


def idle_note(
    record: JobRecord, state: str, workers: Optional[Callable[[], list]] = None
) -> Optional[str]:
    """Why nothing moves a job that waits (``state`` queued, in progress or interrupted), or None
    while something can: a foreground run that stopped, or no live worker on the queue."""
    if state == "interrupted":
        return (f"job {record.id} was a foreground run that stopped; no worker takes it: rerun "
                f"`dflash-batch run` with the same input and settings to resume")  # fmt: skip
    if state not in ("queued", "in_progress"):
        return None
    if workers() if workers is not None else live_workers(record.home):
        return None
    return (f"no worker is serving this queue ({record.home}): start `dflash-batch worker` to run "
            f"job {record.id}")  # fmt: skip


def remove(
    job_ids: List[str], *, files: bool = False, home: Optional[Union[str, Path]] = None
) -> Dict[str, Optional[str]]:
    """Delete finished jobs' records (completed, failed, cancelled, interrupted); with
    ``files``, their result files too, but never a dir another job's record still names, nor
    files in it that are not results. All are checked before any goes: a queued or running one
    (``JobActive``), an unknown or ambiguous id (``JobNotFound``) refuses them all. Returns
    {job id: why its files were kept, or None}."""
    from .runner.jobs import check_removable, remove_job

    home = Path(home) if home else home_dir()
    records = {r.id: r for r in (load_job(home, j) for j in job_ids)}
    for record in records.values():
        check_removable(record)
    going = set(records)
    return {job_id: remove_job(record, files, going) for job_id, record in records.items()}


def prune(
    older_than: float,
    *,
    files: bool = False,
    home: Optional[Union[str, Path]] = None,
    now: Optional[float] = None,
) -> Dict[str, Optional[str]]:
    """``remove`` every finished job created more than ``older_than`` seconds ago (before
    ``now``); queued and running jobs stay."""
    from .runner.jobs import prunable

    home = Path(home) if home else home_dir()
    try:
        checks.finite_number(older_than, 0)
    except checks.BadValue as e:
        raise checks.BadValue(f"older_than: {e}") from None
    old = prunable(home, older_than, time.time() if now is None else now)
    return remove([r.id for r in old], files=files, home=home)


def jobs(home: Optional[Union[str, Path]] = None) -> List[Job]:
    from .runner.jobs import list_jobs

    home = Path(home) if home else home_dir()
    return [Job(r.id, home) for r in list_jobs(home)]
