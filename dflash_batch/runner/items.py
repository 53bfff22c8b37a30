"""Input readers: JSONL (simple rows or OpenAI Batch requests) and Parquet -> ``Item``s.

A problem with one row (bad JSON, wrong type, empty prompt, invalid UTF-8, missing template
field) becomes an ``Item`` with ``error`` set, named by its line or row, so the job still
completes and the row shows up as an error row. A problem with the whole input (missing file,
Parquet without the needed columns, duplicate ids) raises ``InputError``.
"""

from __future__ import annotations

import hashlib
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import orjson

from .. import checks
from ..errors import InputError, RowError
from ..request import BadOption, row_options

Prompt = Union[str, List[Dict[str, str]]]
ROLES = {"system", "user", "assistant", "tool", "developer"}
OPENAI_URLS = {"/v1/chat/completions", "/v1/completions"}


@dataclass
class Item:
    """One prompt to generate, or one row that could not become a prompt (``error`` set)."""

    id: str
    index: int  # 0-based position among the input's rows (blank JSONL lines are not rows)
    where: str  # "line 7" (JSONL: the file's line number) or "row 7" (Parquet: the 7th row); both from 1
    prompt: Optional[Prompt] = None
    options: Dict[str, Any] = field(default_factory=dict)  # per-row max_tokens, temperature, stop, system
    metadata: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    cursor: Optional[Tuple[int, int]] = None  # JSONL: (byte offset, line number) of the row


@dataclass
class Fields:
    """Where a row keeps its id, prompt and messages, and how a prompt is built from it."""

    id_field: Optional[str] = None  # None: "id", then "custom_id"
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    prompt_template: Optional[str] = None  # string.Template over the row's fields: "Summarize: $text"


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt not in ("auto", "jsonl", "openai", "parquet"):
        raise InputError(f"input_format must be auto, jsonl, openai or parquet, not {fmt!r}")
    if fmt != "auto":
        return "jsonl" if fmt == "openai" else fmt
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise InputError(f"{path}: cannot tell the format from the suffix {suffix!r}; set input_format to jsonl or parquet")


def read_items(
    path: Union[str, Path],
    fmt: str = "auto",
    fields: Optional[Fields] = None,
    start: int = 0,
    stop: Optional[int] = None,
    cursor: Optional[Tuple[int, int]] = None,
) -> Iterator[Item]:
    """The rows ``[start, stop)`` of the input as ``Item``s, in file order. Raises
    ``InputError`` for a bad file and for a repeated id (naming both places).

    ``cursor``: the ``Item.cursor`` of row ``start`` from an earlier pass (JSONL: byte offset and
    line number), so a chunk deep in a large file is read without parsing what precedes it.
    Parquet skips whole row groups before ``start`` by itself.
    """
    path = Path(path)
    fields = fields or Fields()
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if not path.is_file():
        raise InputError(f"{path}: not a file")
    kind = detect_format(path, fmt)
    if kind == "parquet":
        rows = _parquet_rows(path, fields, start)
    elif cursor is not None:
        rows = _jsonl_rows(path, start, *cursor)
    else:
        rows = _jsonl_rows(path)
    seen: Dict[str, str] = {}
    for index, where, raw, row, problem, position in rows:
        if index < start:
            continue
        if stop is not None and index >= stop:
            break
        item = _to_item(path, index, where, raw, row, problem, fields)
        item.cursor = position
        if item.id in seen:
            raise InputError(f"{path}: duplicate id {item.id!r} on {seen[item.id]} and {where}")
        seen[item.id] = where
        yield item


def count_rows(path: Union[str, Path], fmt: str = "auto", fields: Optional[Fields] = None) -> Tuple[int, int]:
    """(rows, rows with an error), reading the whole input once; raises ``InputError`` as
    ``read_items`` does. Used at submit time so bad input is reported before any work."""
    n = bad = 0
    for item in read_items(path, fmt, fields):
        n += 1
        bad += item.error is not None
    return n, bad


# -- raw rows -------------------------------------------------------------------------------
def _jsonl_rows(path: Path, index: int = 0, offset: int = 0, line: int = 1):
    """(row index, where, raw bytes, parsed row or None, problem or None, (offset, line)) per
    non-blank line, from byte ``offset`` (the start of line number ``line``, row ``index``)."""
    try:
        handle = path.open("rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from e
    with handle:
        handle.seek(offset)
        for number, raw in enumerate(handle, start=line):
            position = (offset, number)
            offset += len(raw)
            if not raw.strip():
                continue
            yield (index, f"line {number}", raw, *_parse_line(raw), position)
            index += 1


def _parse_line(raw: bytes):
    """(row or None, problem or None) for one JSONL line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        problem = f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        try:  # keep the row's own id when the rest of the line still parses
            row = orjson.loads(raw.decode("utf-8", errors="replace"))
        except orjson.JSONDecodeError:
            row = None
        return (row if isinstance(row, dict) else None), problem
    try:
        row = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        return None, f"malformed JSON: {e}"
    if not isinstance(row, dict):
        return None, f"expected a JSON object, got {_type(row)}"
    return row, None


def _parquet_rows(path: Path, fields: Fields, start: int = 0):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{path}: not a readable Parquet file: {e}") from e
    columns = handle.schema_arrow.names
    if fields.id_field and fields.id_field not in columns:
        raise InputError(f"{path}: id_field {fields.id_field!r} is not a column (columns: {', '.join(columns)})")
    if fields.prompt_template is None and fields.prompt_field not in columns and fields.messages_field not in columns:
        raise InputError(
            f"{path}: no prompt column {fields.prompt_field!r} and no messages column {fields.messages_field!r} "
            f"(columns: {', '.join(columns)}); set prompt_field, messages_field or prompt_template"
        )
    if fields.prompt_template is not None:
        missing = [k for k in _template_keys(fields.prompt_template) if k not in columns]
        if missing:
            raise InputError(
                f"{path}: prompt_template uses {', '.join(map(repr, missing))}, not a column (columns: {', '.join(columns)})"
            )
    # Skip the row groups that end before ``start``.
    groups, number, first = [], 0, None
    for g in range(handle.metadata.num_row_groups):
        size = handle.metadata.row_group(g).num_rows
        if number + size > start:
            groups.append(g)
            first = number if first is None else first
        number += size
    number = first or 0
    if not groups:
        return
    for batch in handle.iter_batches(batch_size=1024, row_groups=groups):
        for row in batch.to_pylist():
            raw = orjson.dumps(row, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
            yield number, f"row {number + 1}", raw, row, None, None
            number += 1


# -- one row -> Item ------------------------------------------------------------------------
def _to_item(path: Path, index: int, where: str, raw: bytes, row, problem, fields: Fields) -> Item:
    derived = f"{path.stem}-{index:06d}-{hashlib.sha1(raw).hexdigest()[:8]}"
    item = Item(id=derived, index=index, where=where)
    if problem is not None:
        item.error = f"{where}: {problem}"
        if row is not None:
            try:
                item.id = _row_id(row, fields) or derived
            except RowError:
                pass
        return item
    try:
        item.id = _row_id(row, fields) or derived
        _bounded(row)
        if isinstance(row.get("body"), dict):
            _openai_row(item, row)
        else:
            _simple_row(item, row, fields)
    except (RowError, BadOption) as e:
        item.error = f"{where}: {e}"
        item.prompt = None
    return item


def _row_id(row: dict, fields: Fields) -> Optional[str]:
    names = [fields.id_field] if fields.id_field else ["id", "custom_id"]
    for name in names:
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise RowError(f"{name!r} must be a string or an integer, got {_type(value)}")
        value = str(value)
        if not value.strip():
            raise RowError(f"{name!r} is empty")
        return value
    return None


def _openai_row(item: Item, row: dict) -> None:
    """``{"custom_id", "method", "url", "body": {"messages"|"prompt", "max_tokens", ...}}``."""
    url = row.get("url", "/v1/chat/completions")
    if url not in OPENAI_URLS:
        raise RowError(f"url {url!r} is not supported (use {' or '.join(sorted(OPENAI_URLS))})")
    method = row.get("method", "POST")
    if method != "POST":
        raise RowError(f"method must be POST, got {method!r}")
    body = row["body"]
    if "messages" in body:
        item.prompt = _messages(body["messages"], "body.messages")
    elif "prompt" in body:
        item.prompt = _text(body["prompt"], "body.prompt")
    else:
        raise RowError("body has neither 'messages' nor 'prompt'")
    if "max_completion_tokens" in body and "max_tokens" not in body:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    item.options = row_options(body, "body.")
    item.metadata = {k: v for k, v in {"model": body.get("model"), "url": url}.items() if v is not None}
    if isinstance(row.get("metadata"), dict):
        item.metadata.update(row["metadata"])


def _simple_row(item: Item, row: dict, fields: Fields) -> None:
    """``{"id"|"custom_id", "prompt"|"messages", max_tokens?, temperature?, stop?, system?, metadata?}``."""
    if fields.prompt_template is not None:
        item.prompt = _text(_fill(fields.prompt_template, row), "prompt_template result")
    elif row.get(fields.messages_field) is not None:
        item.prompt = _messages(row[fields.messages_field], fields.messages_field)
    elif row.get(fields.prompt_field) is not None:
        item.prompt = _text(row[fields.prompt_field], fields.prompt_field)
    else:
        raise RowError(f"no {fields.prompt_field!r} or {fields.messages_field!r} field")
    item.options = row_options(row, "")
    meta = row.get("metadata")
    if isinstance(meta, str):  # Parquet often stores it as JSON text
        try:
            meta = orjson.loads(meta)
        except orjson.JSONDecodeError:
            meta = {"value": meta}
    if meta is not None and not isinstance(meta, dict):
        raise RowError(f"'metadata' must be an object, got {_type(meta)}")
    item.metadata = meta or {}


def _bounded(row: dict) -> None:
    """Each field nests at most ``checks.MAX_NESTING`` levels: the checks below and the result
    files (orjson writes at most 255) walk them recursively."""
    for key, value in row.items():
        try:
            checks.nesting(value)
        except checks.BadValue as e:
            raise RowError(f"{key!r} {e}") from None


def _text(value, name: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"{name!r} must be a string, got {_type(value)}")
    if not value.strip():
        raise RowError(f"{name!r} is empty")
    return value


def _messages(value, name: str) -> List[Dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{name!r} must be a non-empty list of messages, got {_type(value) if value != [] else 'an empty list'}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowError(f"{name}[{i}] must be an object with 'role' and 'content', got {_type(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RowError(f"{name}[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise RowError(f"{name}[{i}].content must be a string, got {_type(content)}")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out if m["role"] != "system"):
        raise RowError(f"{name!r} has no non-empty user or assistant content")
    return out


def _template_keys(template: str) -> List[str]:
    keys = []
    for m in string.Template.pattern.finditer(template):
        name = m.group("named") or m.group("braced")
        if name and name not in keys:
            keys.append(name)
    return keys


def _fill(template: str, row: dict) -> str:
    values = {k: v if isinstance(v, str) else orjson.dumps(v, default=str).decode() for k, v in row.items()}
    missing = [k for k in _template_keys(template) if row.get(k) is None]
    if missing:
        raise RowError(f"prompt_template needs field {missing[0]!r}, which the row lacks")
    try:
        return string.Template(template).substitute(values)
    except ValueError as e:
        raise RowError(f"prompt_template is malformed: {e}") from e


_type = checks.json_type
