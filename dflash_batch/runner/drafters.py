"""A job's own drafter revisions: adapted drafters kept in its record, and which one is in force.

Layout, in the job's record folder (``jobs/<job id>/``)::

    drafters/rev-0001/       an adapted drafter (z-lab format) and its training record, training.json
    drafters/.work/          an adaptation under way (training/adapt.py), wiped when one starts
    drafters/.lock           held (flock) while an adaptation runs: one at a time per job
    drafters.json            {"in_force": "rev-0001" or null, "history": [one entry per attempt]}

``drafters.json`` is written last and atomically, so a process killed mid-adaptation leaves the
drafter in force as it was (a revision folder without an entry is never used). The runner only
reads and records here; training a revision needs MLX and lives in ``training/adapt.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import orjson

from ..files import write_atomic
from .lock import DirLock

log = logging.getLogger("dflash_batch.runner")
STATE = "drafters.json"
FOLDER = "drafters"
WORK = ".work"
TRAINING_RECORD = "training.json"
OWN = "the job's own drafter"


def folder(record) -> Path:
    return record.dir / FOLDER


def state(record) -> Dict[str, Any]:
    try:
        return orjson.loads((record.dir / STATE).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return {"in_force": None, "history": []}


def _write(record, data: Dict[str, Any]) -> None:
    write_atomic(record.dir / STATE, orjson.dumps(data, option=orjson.OPT_INDENT_2))


def in_force(record) -> Tuple[Optional[str], Optional[Path]]:
    """(revision, its folder) the job drafts with now; (None, None): the job's own drafter."""
    name = state(record).get("in_force")
    return (name, folder(record) / name) if name else (None, None)


def next_name(record) -> str:
    """A revision name no attempt and no folder (a killed attempt's) has used."""
    taken = {h.get("revision") for h in state(record)["history"]}
    taken |= {p.name for p in folder(record).glob("rev-*")} if folder(record).is_dir() else set()
    n = 1
    while f"rev-{n:04d}" in taken:
        n += 1
    return f"rev-{n:04d}"


def record_attempt(record, entry: Dict[str, Any], adopt: bool = False) -> Dict[str, Any]:
    """Add an attempt to the history (``entry``: revision, outcome, acceptance before and after...);
    with ``adopt``, its revision is in force from now on."""
    data = state(record)
    entry = dict(entry, at=time.time(), replaces=data.get("in_force"))
    data["history"].append(entry)
    if adopt:
        data["in_force"] = entry["revision"]
    _write(record, data)
    return entry


def refuse(record, name: str, error: str) -> Optional[str]:
    """A revision that failed to load: out of force (the revision it replaced is in force again)
    and marked refused. Returns the revision in force now."""
    data = state(record)
    entries = [h for h in data["history"] if h.get("revision") == name]
    for h in entries:
        h.update(outcome="refused", refused=error)
    if data.get("in_force") == name:
        data["in_force"] = entries[-1].get("replaces") if entries else None
    _write(record, data)
    return data["in_force"]


def adapt_lock(record) -> DirLock:
    """The job's adaptation lock (raises ``lock.Locked`` at once while another process adapts)."""
    folder(record).mkdir(parents=True, exist_ok=True)
    return DirLock(folder(record), wait=0.0)


def adapt_due(record) -> bool:
    """Does the job spec's ``adapt:`` block ask for an adaptation now: enough finished rows and
    no attempt of its own yet (a refused or rejected attempt is not repeated by itself; ``dflash-batch
    adapt`` tries again)."""
    plan = record.spec.adapt
    if not plan or any(h.get("trigger") == "spec" for h in state(record)["history"]):
        return False
    return ok_rows(record) >= plan.get("after_rows", 0)


def ok_rows(record) -> int:
    table = record.store().read(["status"])
    return table.column("status").to_pylist().count("ok") + sum(
        r.get("status") == "ok" for r in record.store().journal_rows()
    )


def use_in_force(engine, record) -> Any:
    """Make ``engine`` (between streams) draft with the job's revision in force; a revision that
    fails to load is refused and the one before it used. Engines without ``use_drafter`` (plain
    AR, the runner tests' fake) are left as they are."""
    if not hasattr(engine, "use_drafter") or getattr(engine, "loaded_drafter", None) is None:
        return engine
    name, path = in_force(record)
    tried = set()  # each revision once: a refusal that could not be recorded never loops
    while name != getattr(engine, "drafter_revision", None) and name not in tried:
        tried.add(name)
        try:
            engine.use_drafter(path, name)
            log.info("job %s: drafting with %s", record.id, name or "its own drafter")
        except Exception as e:  # a damaged or mismatched revision: the job goes on with the old one
            log.error("job %s: drafter %s refused (%s: %s); the one before it stays", record.id, name,
                      type(e).__name__, e)  # fmt: skip
            refuse(record, name, f"{type(e).__name__}: {e}")
            name, path = in_force(record)
    return engine


def summary(record) -> Dict[str, Any]:
    """What ``status`` shows: the revision in force, each attempt, and per revision the rows it
    drafted and their mean tokens per cycle (the acceptance before and after a switch)."""
    data = state(record)
    table = record.store().read(["status", "drafter_revision", "tokens_per_cycle"])
    rows = [r for r in table.to_pylist() if r["status"] == "ok"]
    by: Dict[str, List[float]] = {}
    for r in rows:
        by.setdefault(r["drafter_revision"] or "job", []).append(r["tokens_per_cycle"])
    drafted = {name: {"rows": len(v), "mean_tokens_per_cycle": _mean([x for x in v if x is not None])}
               for name, v in by.items()}  # fmt: skip
    return {"in_force": data.get("in_force"), "history": data["history"], "drafted": drafted}


def summary_lines(summary_: Dict[str, Any]) -> List[str]:
    """``summary`` as text lines (empty when the job never adapted)."""
    lines = []
    for h in summary_["history"]:
        before, after = h.get("held_out_before"), h.get("held_out_after")
        scores = (
            f": held-out acceptance {before:.3f} -> {after:.3f}"
            if before is not None and after is not None
            else ""
        )
        lines.append(f"  drafter {h.get('revision') or '-'} {h.get('outcome')}{scores}"
                     + (f" ({h['note']})" if h.get("note") else ""))  # fmt: skip
    if summary_["history"] or len(summary_["drafted"]) > 1:
        for name, d in summary_["drafted"].items():
            tau = d["mean_tokens_per_cycle"]
            lines.append(
                f"  rows drafted by {name}: {d['rows']}, tau {'-' if tau is None else f'{tau:.2f}'}"
            )
        lines.append(f"  drafter in force: {summary_['in_force'] or OWN}")
    return lines


def _mean(values: List[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None
