"""What speculation saved on a job, from its result rows (docs/runner.md).

Each row of a drafting engine carries ``decode_share_s``, its share of the decode cycles it rode
in, and ``plain_seconds_est``, what its tokens would have taken with plain decoding at those
batch sizes, from the measured plain-cycle costs. Over the drafted rows, their ratio is the job's
speedup against plain decoding.

Control rows (``--control``) were decoded plainly in the same batch: their rate, tokens over
their share of the cycles, is measured, not estimated. They ride in the drafting cycles and pay
their share of them, so their rate is at most what plain decoding gives (equal where the cycles
were plain), and the drafted rows' rate against theirs is at least the speedup; the estimate
lies between the two.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

COLUMNS = ["completion_tokens", "block_size", "decode_share_s", "plain_seconds_est", "control"]


def figures(rows: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """The job's figures over its ok rows decoded with a drafter (``block_size`` > 0) that spent
    time decoding: ``rows``, ``decode_s`` and ``plain_s_est`` summed over the drafted rows with
    an estimate, ``speedup`` (their ratio), ``tokens_per_s`` and ``plain_tokens_per_s_est``
    (their decoded tokens over each); ``control_rows``, ``control_tokens_per_s`` and
    ``control_speedup`` (the drafted rows' rate over the control rows'). None where undefined."""
    timed = [r for r in rows if r.get("status") == "ok" and (r.get("block_size") or 0) > 0
             and (r.get("decode_share_s") or 0) > 0]  # fmt: skip
    drafted = [r for r in timed if not r.get("control") and r.get("plain_seconds_est") is not None]
    control = [r for r in timed if r.get("control")]
    decode, plain = _sum(drafted, "decode_share_s"), _sum(drafted, "plain_seconds_est")
    rate, control_rate = _rate(drafted, decode), _rate(control, _sum(control, "decode_share_s"))
    return {
        "rows": len(drafted),
        "decode_s": decode,
        "plain_s_est": plain,
        "speedup": plain / decode if drafted else None,
        "tokens_per_s": rate,
        "plain_tokens_per_s_est": _rate(drafted, plain),
        "control_rows": len(control),
        "control_tokens_per_s": control_rate,
        "control_speedup": rate / control_rate if rate and control_rate else None,
    }


def text(f: Dict[str, Any]) -> Optional[str]:
    """The figures as the run summary and ``status`` say them (None: nothing was drafted)."""
    if f["speedup"] is None:
        return None
    lines = [
        f"speculation: {f['speedup']:.2f}x plain decoding on this job ({f['decode_s']:.2f} s of decoding "
        f"against {f['plain_s_est']:.2f} s estimated for plain decoding, {f['rows']} rows)"
    ]
    if f["control_tokens_per_s"] is not None:
        lines.append(
            f"control: {f['control_rows']} rows decoded plainly in the same batch ran at "
            f"{f['control_tokens_per_s']:.1f} tok/s, the drafted rows at {f['tokens_per_s']:.1f} "
            f"({_times(f['control_speedup'])}); plain decoding estimated at "
            f"{f['plain_tokens_per_s_est']:.1f}"
        )
    return "\n".join(lines)


def _times(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _sum(rows: List[Dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows)


def _rate(rows: List[Dict[str, Any]], seconds: float) -> Optional[float]:
    """Decoded tokens (the first of each row comes from its prefill) per second."""
    tokens = sum(max((r.get("completion_tokens") or 0) - 1, 0) for r in rows)
    return tokens / seconds if rows and seconds > 0 else None
