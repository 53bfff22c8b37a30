"""Result rows -> JSON lines, or OpenAI Batch API output lines (joined on ``custom_id``)."""

from __future__ import annotations

from datetime import datetime
from typing import IO, Any, Dict, List, Optional

import orjson
import pyarrow as pa


def _plain(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


def openai_line(row: Dict[str, Any], model: Optional[str] = None) -> Dict[str, Any]:
    """One row in the shape of an OpenAI batch output line; failed rows carry ``error``."""
    return openai_samples([row], model)


def openai_samples(rows: List[Dict[str, Any]], model: Optional[str] = None) -> Dict[str, Any]:
    """The rows of one item's samples as one OpenAI batch output line: one choice per sample
    (``index`` = its sample index), usage summed over the samples (the prompt counted once);
    an item with a failed sample is a failed line naming that sample's error."""
    rows = sorted(rows, key=lambda r: r.get("sample_index") or 0)
    first = rows[0]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        return {
            "id": f"batch_req_{first['id']}",
            "custom_id": first["id"],
            "response": None,
            "error": {"code": "generation_error", "message": failed[0]["error"]},
        }
    prompt = first["prompt_tokens"] or 0
    completion = sum(r["completion_tokens"] or 0 for r in rows)
    created = max(
        (r["finished_at"] for r in rows),
        key=lambda t: t.timestamp() if isinstance(t, datetime) else 0,
    )
    text = _url(first) == "/v1/completions"  # answered in that endpoint's own shape
    body = {
        "id": f"{'cmpl' if text else 'chatcmpl'}-{first['id']}",
        "object": "text_completion" if text else "chat.completion",
        "created": int(created.timestamp()) if isinstance(created, datetime) else None,
        "model": model,
        "choices": [_text_choice(r) if text else _chat_choice(r) for r in rows],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return {
        "id": f"batch_req_{first['id']}",
        "custom_id": first["id"],
        "response": {"status_code": 200, "request_id": first["id"], "body": body},
        "error": None,
    }


def _url(row: Dict[str, Any]) -> Optional[str]:
    """The OpenAI endpoint the row's input line named (kept in its metadata), if any."""
    try:
        meta = orjson.loads(row.get("metadata") or "{}")
    except orjson.JSONDecodeError:
        return None
    return meta.get("url") if isinstance(meta, dict) else None


def _chat_choice(row: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "index": row.get("sample_index") or 0,
        "message": {"role": "assistant", "content": row["output"]},
        "logprobs": openai_logprobs(row.get("logprobs")),
        "finish_reason": row["finish_reason"],
    }


def _text_choice(row: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "text": row["output"],
        "index": row.get("sample_index") or 0,
        "logprobs": text_logprobs(row.get("logprobs")),
        "finish_reason": row["finish_reason"],
    }


def text_logprobs(entries: Optional[List[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """A row's ``logprobs`` column as OpenAI's completions ``choices[].logprobs`` (null when not
    asked): tokens, their log-probabilities, the top alternatives and each token's text offset."""
    if entries is None:
        return None
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e["top_logprobs"] or []} for e in entries
        ],
        "text_offset": offsets,
    }


def openai_logprobs(entries: Optional[List[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """A row's ``logprobs`` column as OpenAI's chat ``choices[].logprobs`` (null when not asked)."""
    if entries is None:
        return None

    def one(e):
        return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

    return {
        "content": [
            dict(one(e), top_logprobs=[one(t) for t in e["top_logprobs"] or []]) for e in entries
        ]
    }


def write_lines(
    table: pa.Table, out: IO[bytes], fmt: str = "jsonl", model: Optional[str] = None
) -> int:
    """Write every row as one JSON line: ``jsonl`` (the row itself) or ``openai`` (one line per
    item, its samples as choices, in the order items first appear)."""
    rows = table.to_pylist()
    if fmt == "openai":
        items: Dict[str, List[Dict[str, Any]]] = {}
        for row in rows:
            items.setdefault(row["id"], []).append(row)
        lines = [openai_samples(group, model) for group in items.values()]
    else:
        lines = [_plain(row) for row in rows]
    for line in lines:
        out.write(orjson.dumps(line, default=str) + b"\n")
    return len(lines)
