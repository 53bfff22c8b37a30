"""The status page at ``/`` and its figures as JSON (``/status.json``): each recent job (a
batch's or any other on the home) with its progress, whole-job output tok/s, acceptance, its
speedup against plain decoding and the acceptance-length histogram, drawn as inline SVG. The
page reloads itself while a job runs."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..runner.jobs import JobRecord, list_jobs

ACTIVE = ("queued", "in_progress", "running")
RECENT_JOBS = 20
REFRESH_S = 2


def figures(home: Path, batch_of: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """``{"jobs": [...], "active": bool}``, newest job first; ``batch_of``: {job id: batch}."""
    jobs = [job_figures(r, batch_of.get(r.id)) for r in reversed(list_jobs(home)[-RECENT_JOBS:])]
    return {"jobs": jobs, "active": any(j["state"] in ACTIVE for j in jobs)}


def job_figures(record: JobRecord, batch: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    status = record.status()
    rows = [r for r in record.store().read(["id", "status", "completion_tokens", "started_at",
                                            "finished_at", "acceptance_histogram"]).to_pylist()
            if r["status"] == "ok"]  # fmt: skip
    ids = set(record.ids())
    rows = [r for r in rows if r["id"] in ids]
    return {
        "id": record.id,
        "name": status["name"],
        "batch": None if batch is None else {"id": batch["id"], "status": batch["status"]},
        "state": status["state"],
        "total": status["total"],
        "done": status["done"],
        "ok": status["ok"],
        "failed": status["failed"],
        "progress": status["done"] / status["total"] if status["total"] else 1.0,
        "completion_tokens": status["completion_tokens"],
        "tokens_per_s": whole_job_rate(rows),
        "mean_acceptance_drafted": status["mean_acceptance_drafted"],
        "mean_tokens_per_cycle": status["mean_tokens_per_cycle"],
        "speedup_vs_plain": status["speedup_vs_plain"],  # what speculation saved (runner/saved.py)
        "acceptance_histogram": histogram(rows),
    }


def whole_job_rate(rows: List[Dict[str, Any]]) -> Optional[float]:
    """Output tokens over the span from the first row's start to the last row's end."""
    spans = [(r["started_at"], r["finished_at"]) for r in rows
             if r["started_at"] and r["finished_at"]]  # fmt: skip
    if not spans:
        return None
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    seconds = seconds.total_seconds() if not isinstance(seconds, (int, float)) else seconds
    tokens = sum(r["completion_tokens"] or 0 for r in rows)
    return tokens / seconds if seconds > 0 else None


def histogram(rows: List[Dict[str, Any]]) -> List[int]:
    """Verify cycles by the tokens each committed, summed over the rows."""
    out: List[int] = []
    for r in rows:
        for k, v in enumerate(r["acceptance_histogram"] or []):
            out.extend([0] * (k + 1 - len(out)))
            out[k] += v
    return out


def svg_histogram(counts: List[int], width: int = 180, height: int = 64) -> str:
    """Bars of cycles committing 0, 1, 2... tokens, labelled below; empty when no cycles."""
    if not counts or not any(counts):
        return '<span class="none">no verify cycles yet</span>'
    top = max(counts)
    step = width / len(counts)
    bars = []
    for k, n in enumerate(counts):
        h = (height - 14) * n / top
        x = k * step
        bars.append(f'<rect x="{x + 1:.1f}" y="{height - 14 - h:.1f}" width="{step - 2:.1f}" '
                    f'height="{h:.1f}"><title>{k} tokens: {n} cycles</title></rect>'
                    f'<text x="{x + step / 2:.1f}" y="{height - 2}">{k}</text>')  # fmt: skip
    return (
        f'<svg class="hist" width="{width}" height="{height}" role="img" '
        f'aria-label="acceptance-length histogram">{"".join(bars)}</svg>'
    )


STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: .9em; }
td, th { padding: .35em .6em; border-bottom: 1px solid #ddd; } td.id { font-size: .8em; }
th { text-align: left; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { width: 120px; height: 10px; background: #eee; } .bar div { height: 10px; background: #3a7; }
svg.hist rect { fill: #37a; } svg.hist text { font-size: 9px; text-anchor: middle; fill: #555; }
.none { color: #888; font-size: .9em; }
"""


def html_page(data: Dict[str, Any], title: str = "dflash-batch serve") -> str:
    refresh = f'<meta http-equiv="refresh" content="{REFRESH_S}">' if data["active"] else ""
    rows = "".join(_row(j) for j in data["jobs"]) or '<tr><td colspan="9">no jobs yet</td></tr>'
    return (
        f'<!doctype html><html><head><meta charset="utf-8">{refresh}<title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>"
        '<p>Jobs and batches on this home, newest first (<a href="/status.json">as JSON</a>).</p>'
        "<table><thead><tr><th>job</th><th>batch</th><th>state</th><th>progress</th>"
        '<th class="num">output tok/s</th><th class="num">acceptance</th>'
        '<th class="num">tokens/cycle</th><th class="num">vs plain</th><th>acceptance length</th></tr></thead>'
        f"<tbody>{rows}</tbody></table>{_interactive(data.get('interactive'))}</body></html>"
    )


def _interactive(counts: Optional[Dict[str, Any]]) -> str:
    """Interactive traffic beside the jobs: requests answered, streamed, cancelled, refused, waiting."""
    if counts is None:
        return ""
    cells = "".join(f'<td class="num" data-name="{k}">{counts[k]}</td>'
                    for k in ("requests", "streams", "cancelled", "refused", "waiting"))  # fmt: skip
    return (
        '<h2>Interactive requests</h2><table id="interactive"><thead><tr><th>requests</th>'
        "<th>streamed</th><th>cancelled</th><th>refused</th><th>waiting now</th></tr></thead>"
        f"<tbody><tr>{cells}</tr></tbody></table>"
    )


def _row(job: Dict[str, Any]) -> str:
    batch = job["batch"]
    batch_text = f"{escape(batch['id'])} ({escape(batch['status'])})" if batch else "-"
    pct = 100 * job["progress"]
    return (
        f'<tr class="job" data-state="{escape(job["state"])}"><td class="id">{escape(job["id"])}'
        f'</td><td class="id">{batch_text}</td><td>{escape(job["state"])}</td>'
        f'<td><div class="bar"><div style="width:{pct:.0f}%"></div></div>'
        f"{job['done']}/{job['total']} ({job['failed']} failed)</td>"
        f'<td class="num">{_fmt(job["tokens_per_s"], ".1f")}</td>'
        f'<td class="num">{_fmt(job["mean_acceptance_drafted"], ".2f")}</td>'
        f'<td class="num">{_fmt(job["mean_tokens_per_cycle"], ".2f")}</td>'
        f'<td class="num">{_fmt(job["speedup_vs_plain"], ".2f")}{"x" if job["speedup_vs_plain"] else ""}</td>'
        f"<td>{svg_histogram(job['acceptance_histogram'])}</td></tr>"
    )


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)
