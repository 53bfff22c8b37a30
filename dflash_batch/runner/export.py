"""Result rows -> JSON lines, or OpenAI Batch API output lines (joined on ``custom_id``)."""

from __future__ import annotations

from datetime import datetime
from typing import IO, Any, Dict, Optional

import orjson
import pyarrow as pa


def _plain(row: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}


def openai_line(row: Dict[str, Any], model: Optional[str] = None) -> Dict[str, Any]:
    """One row in the shape of an OpenAI batch output line; failed rows carry ``error``."""
    if row["status"] != "ok":
        return {
            "id": f"batch_req_{row['id']}",
            "custom_id": row["id"],
            "response": None,
            "error": {"code": "generation_error", "message": row["error"]},
        }
    prompt, completion = row["prompt_tokens"] or 0, row["completion_tokens"] or 0
    created = row["finished_at"]
    body = {
        "id": f"chatcmpl-{row['id']}",
        "object": "chat.completion",
        "created": int(created.timestamp()) if isinstance(created, datetime) else None,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": row["output"]},
                "finish_reason": row["finish_reason"],
            }
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    return {
        "id": f"batch_req_{row['id']}",
        "custom_id": row["id"],
        "response": {"status_code": 200, "request_id": row["id"], "body": body},
        "error": None,
    }


def write_lines(table: pa.Table, out: IO[bytes], fmt: str = "jsonl", model: Optional[str] = None) -> int:
    """Write every row as one JSON line: ``jsonl`` (the row itself) or ``openai``."""
    n = 0
    for row in table.to_pylist():
        line = openai_line(row, model) if fmt == "openai" else _plain(row)
        out.write(orjson.dumps(line, default=str) + b"\n")
        n += 1
    return n
