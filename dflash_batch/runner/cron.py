"""Cron schedules from YAML: periodic Huey tasks that submit a job, and the catch-up of runs
missed while no worker was up. Times are UTC (naive datetimes)."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from .. import checks
from ..errors import ScheduleNotFound
from ..files import write_atomic
from .items import InputError
from .jobs import JobRecord, create_job
from .queue import Queue
from .spec import SpecError, cron_fields, default_name, load_spec

log = logging.getLogger("dflash_batch.worker")
CATCH_UP_DAYS = 35  # how far back a starting worker looks for a missed cron run


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)


def last_due(
    expression: str, since: datetime.datetime, now: datetime.datetime
) -> Optional[datetime.datetime]:
    """The latest minute in (since, now] that the cron expression matches, looking back at most
    CATCH_UP_DAYS; None if there is none."""
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
    """The first minute after ``now`` that the cron expression matches, looking ahead at most
    CATCH_UP_DAYS; None if there is none."""
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


class Cron:
    """The schedules one worker runs, as periodic tasks on ``queue``'s Huey."""

    def __init__(self, queue: Queue):
        self.queue = queue
        self.home = queue.home
        self.schedules: Dict[str, Tuple[str, Path]] = {}  # name -> (cron expression, YAML file)

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
            self.fire(name, Path(path))

        self.queue.huey.periodic_task(
            crontab(**cron_fields(spec.schedule)), name=f"dflash_batch.cron.{name}"
        )(submit_scheduled)
        self.schedules[name] = (spec.schedule, Path(path))
        log.info("schedule registered: %s at %r (UTC) from %s", name, spec.schedule, path)
        return name, spec.schedule

    def fire(self, name: str, path: Path) -> None:
        """What the periodic task does when its minute comes: submit the job, unless a start-up
        catch-up did this minute. A schedule removed or broken since the worker started is one
        log line (the task fires again next time), not a traceback."""
        if not path.exists():
            log.info(
                "schedule %s was removed (%s is gone): skipped; restart the worker to drop it",
                name,
                path,
            )
            return
        now = utcnow()
        ran = self.recorded_run(name)
        if ran is not None and ran >= now.replace(second=0, microsecond=0):
            return
        try:
            self.submit_schedule(name, path, now)
        except (SpecError, InputError, OSError) as e:
            log.error("schedule %s: could not submit its run: %s", name, e)

    def submit_schedule(self, name: str, path: Path, when: datetime.datetime) -> JobRecord:
        """Submit a scheduled job now (re-reading its YAML) and record ``when`` as its last run."""
        record = create_job(load_spec(path), self.home)
        n = self.queue.enqueue_job(record)
        state = self.last_run_file(name)
        state.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(state, when.isoformat(timespec="seconds"))
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
