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
from ..request import MAX_TOP_LOGPROBS, BadOption, row_options

Prompt = Union[str, List[Dict[str, str]]]
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
OPENAI_URLS = {CHAT_URL, COMPLETIONS_URL}


@dataclass
class Item:
    """One prompt to generate, or one row that could not become a prompt (``error`` set)."""

    id: str
    index: int  # 0-based position among the input's rows (blank JSONL lines are not rows)
    where: str  # "line 7" (JSONL: the file's line number) or "row 7" (Parquet: the 7th row); both from 1
    prompt: Optional[Prompt] = None
    # per-row max_tokens, temperature, stop, system
    options: Dict[str, Any] = field(default_factory=dict)
    metadata: Dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    cursor: Optional[Tuple[int, int]] = None  # JSONL: (byte offset, line number) of the row


@dataclass
class Fields:
    """Where a row keeps its id, prompt and messages, and how a prompt is built from it."""

    id_field: Optional[str] = None  # None: "id", then "custom_id"
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    # string.Template over the row's fields: "Summarize: $text"
    prompt_template: Optional[str] = None


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
    raise InputError(
        f"{path}: cannot tell the format from the suffix {suffix!r}; set input_format to jsonl or parquet"
    )


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


def count_rows(
    path: Union[str, Path], fmt: str = "auto", fields: Optional[Fields] = None
) -> Tuple[int, int]:
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
        first = offset == 0
        for number, raw in enumerate(handle, start=line):
            position = (offset, number)
            offset += len(raw)
            if not raw.strip():
                continue
            if first:
                _refuse_json_document(path, number, raw)
                first = False
            yield (index, f"line {number}", raw, *_parse_line(raw), position)
            index += 1


def _refuse_json_document(path: Path, number: int, raw: bytes) -> None:
    """A file whose first row opens a JSON array, or a JSON object spread over lines, is one
    JSON document, not JSON Lines: refused before any work rather than read as error rows."""
    start = raw.strip()
    if start.startswith(b"["):
        shape = "opens a JSON array"
    elif start == b"{":
        shape = "opens a JSON object spread over several lines"
    else:
        return
    raise InputError(
        f"{path}: line {number} {shape}; the input must be JSON Lines, one object per line "
        f"(an array of rows converts with: jq -c '.[]' {path.name} > {path.stem}.jsonl)"
    )


def _parse_line(raw: bytes):
    """(row or None, problem or None) for one JSONL line."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")  # so a column in a message is on this line
    except UnicodeDecodeError as e:
        problem = f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        try:  # keep the row's own id when the rest of the line still parses
            row = orjson.loads(raw.decode("utf-8", errors="replace"))
        except orjson.JSONDecodeError:
            row = None
        return (row if isinstance(row, dict) else None), problem
    try:
        row = orjson.loads(text)
    except orjson.JSONDecodeError as e:  # orjson's own text names line 1 of the one line it saw
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
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
        raise InputError(
            f"{path}: id_field {fields.id_field!r} is not a column (columns: {', '.join(columns)})"
        )
    prompts = (fields.prompt_field, fields.messages_field, "body")  # body: OpenAI Batch requests
    if fields.prompt_template is None and not any(name in columns for name in prompts):
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
            raw = orjson.dumps(
                row, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
            )
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
        if _is_openai(row):
            _openai_row(item, row)
        else:
            _simple_row(item, row, fields)
    except (RowError, BadOption) as e:
        item.error = f"{where}: {e}"
        item.prompt = None
    return item


def _is_openai(row: dict) -> bool:
    """An OpenAI Batch line: a ``body`` object, or a ``body`` beside ``url`` or ``method`` (a
    plain row may have a field of its own named body)."""
    body = row.get("body")
    return isinstance(body, dict) or ("body" in row and ("url" in row or "method" in row))


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
    """``{"custom_id", "method", "url", "body": {"messages"|"prompt", "max_tokens", ...}}``.
    ``/v1/completions`` takes a raw ``prompt``: no chat template, as OpenAI's endpoint."""
    # a null field is an absent one, as Parquet gives a row the struct fields of every row
    url = CHAT_URL if row.get("url") is None else row["url"]
    if not isinstance(url, str):
        raise RowError(f"'url' must be a string, got {_type(url)}")
    if url not in OPENAI_URLS:
        use = " or ".join(sorted(OPENAI_URLS))
        raise RowError(f"url {checks.show(url)} is not supported (use {use})")
    method = "POST" if row.get("method") is None else row["method"]
    if method != "POST":
        raise RowError(f"'method' must be 'POST', got {checks.show(method)}")
    body = row.get("body")
    if not isinstance(body, dict):
        raise RowError(f"'body' must be an object, got {_type(body)}")
    if url == COMPLETIONS_URL:
        if body.get("messages") is not None:
            raise RowError(
                f"'body.messages' is for {CHAT_URL}; {COMPLETIONS_URL} takes 'body.prompt'"
            )
        item.prompt = _text(body.get("prompt"), "body.prompt")
    elif body.get("messages") is not None:
        item.prompt = _messages(body["messages"], "body.messages")
    elif body.get("prompt") is not None:
        item.prompt = _text(body["prompt"], "body.prompt")
    else:
        raise RowError("'body' has neither 'messages' nor 'prompt'")
    if url == COMPLETIONS_URL:
        body = _completions_logprobs(body)
    item.options = _openai_options(body)
    if url == COMPLETIONS_URL:
        item.options["chat_template"] = False
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RowError(f"'body.model' must be a string, got {_type(model)}")
    meta = row.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise RowError(f"'metadata' must be an object, got {_type(meta)}")
    item.metadata = {"model": model} if model is not None else {}
    item.metadata.update(meta or {})
    item.metadata["url"] = url  # the export's shape follows it (runner/export.py)


def _completions_logprobs(body: dict) -> dict:
    """/v1/completions' ``logprobs`` is a count (the top alternatives per token, 0 for the
    chosen token's alone), where chat's is a boolean beside ``top_logprobs``."""
    value = body.get("logprobs")
    if isinstance(value, bool) or not isinstance(value, int):
        return body  # null, or refused by the boolean check naming 'body.logprobs'
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        top = MAX_TOP_LOGPROBS
        raise RowError(f"'body.logprobs' must be an integer from 0 to {top}, got {value}")
    return dict(body, logprobs=True, top_logprobs=value)


def _openai_options(body: dict) -> Dict[str, Any]:
    """``row_options`` of a body; ``max_completion_tokens`` (OpenAI's newer name) stands for
    ``max_tokens`` where that is not given, and is named as itself in a refusal."""
    if body.get("max_completion_tokens") is None or body.get("max_tokens") is not None:
        return row_options(body, "body.")
    try:
        return row_options(dict(body, max_tokens=body["max_completion_tokens"]), "body.")
    except BadOption as e:
        named = str(e).replace("'body.max_tokens'", "'body.max_completion_tokens'")
        raise BadOption(named) from None


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
    try:
        return checks.chat_messages(value, name)
    except checks.BadValue as e:
        raise RowError(str(e)) from None


def _template_keys(template: str) -> List[str]:
    keys = []
    for m in string.Template.pattern.finditer(template):
        name = m.group("named") or m.group("braced")
        if name and name not in keys:
            keys.append(name)
    return keys


def _fill(template: str, row: dict) -> str:
    values = {
        k: v if isinstance(v, str) else orjson.dumps(v, default=str).decode()
        for k, v in row.items()
    }
    missing = [k for k in _template_keys(template) if row.get(k) is None]
    if missing:
        raise RowError(f"prompt_template needs field {missing[0]!r}, which the row lacks")
    try:
        return string.Template(template).substitute(values)
    except ValueError as e:
        raise RowError(f"prompt_template is malformed: {e}") from e


_type = checks.json_type
