"""Files of the Files API under ``<home>/serve/files/<file id>/``: ``content`` (the bytes as
uploaded or produced) and ``file.json`` (the OpenAI file object and what validation learnt).

Ids are generated here (``file-`` and 24 hex digits) and checked against that shape before any
path is made of them; a client's file name is kept as a label only, never as a path.
"""

from __future__ import annotations

import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Set

import orjson

from ..files import write_atomic
from ..runner.items import OPENAI_URLS
from .errors import bad_request, not_found

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
MAX_FILENAME = 255
COPY_BLOCK = 2**20


@dataclass(frozen=True)
class Limits:
    """What one input file may hold: OpenAI's limits by default."""

    max_requests: int = 50_000
    max_bytes: int = 200 * 2**20


@dataclass
class Checked:
    """What validating a batch input learnt: its requests and the endpoints they name."""

    requests: int
    urls: Set[str]


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def check_filename(name: Optional[str]) -> str:
    """A file name as a label: a plain name, not a path, not empty, printable."""
    if not name or not name.strip():
        raise bad_request("the uploaded file has no file name", "file", "invalid_file_name")
    bad = any(c in name for c in "/\\\0") or name in (".", "..") or not name.isprintable()
    if bad or len(name) > MAX_FILENAME:
        raise bad_request(
            f"file name {name[:80]!r} must be a plain name (no path, at most "
            f"{MAX_FILENAME} characters)",
            "file",
            "invalid_file_name",
        )
    return name


class FileStore:
    def __init__(self, home: Path, clock: Callable[[], float] = time.time):
        self.root = Path(home) / "serve" / "files"
        self.clock = clock

    def folder(self, file_id: str) -> Path:
        """The folder of an existing file; ``not_found`` for any other id, path-like or not."""
        if not isinstance(file_id, str) or not FILE_ID.fullmatch(file_id):
            raise not_found(
                f"no file {file_id!r}: file ids look like file-<24 hex digits>", "file_id"
            )
        folder = self.root / file_id
        if not (folder / "file.json").is_file():
            raise not_found(f"no file {file_id!r}", "file_id")
        return folder

    def record(self, file_id: str) -> Dict[str, Any]:
        return orjson.loads((self.folder(file_id) / "file.json").read_bytes())

    def get(self, file_id: str) -> Dict[str, Any]:
        return self.record(file_id)["object"]

    def content(self, file_id: str) -> Path:
        return self.folder(file_id) / "content"

    def list(self, purpose: Optional[str] = None) -> List[Dict[str, Any]]:
        """Every file object, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for folder in self.root.iterdir():
            if FILE_ID.fullmatch(folder.name) and (folder / "file.json").is_file():
                found.append(orjson.loads((folder / "file.json").read_bytes()))
        found.sort(key=lambda r: (r["created"], r["object"]["id"]))
        return [r["object"] for r in found if purpose in (None, r["object"]["purpose"])]

    def delete(self, file_id: str) -> Dict[str, Any]:
        shutil.rmtree(self.folder(file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    def upload(
        self, source: BinaryIO, filename: Optional[str], purpose: Optional[str], limits: Limits
    ) -> Dict[str, Any]:
        """Store an upload after checking it whole; a refused one leaves nothing behind."""
        if purpose not in UPLOAD_PURPOSES:
            raise bad_request(
                f"purpose {purpose!r} is not supported here: use 'batch'",
                "purpose",
                "invalid_purpose",
            )
        filename = check_filename(filename)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".upload-", dir=self.root))
        try:
            size = _copy_bounded(source, staging / "content", limits.max_bytes)
            checked = check_batch_input(staging / "content", limits)
            return self._commit(staging, filename, purpose, size, checked)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def add(self, data: bytes, filename: str, purpose: str = OUTPUT_PURPOSE) -> Dict[str, Any]:
        """Store a file this server made (a batch's output or error file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".output-", dir=self.root))
        try:
            (staging / "content").write_bytes(data)
            return self._commit(staging, filename, purpose, len(data), None)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _commit(
        self, staging: Path, filename: str, purpose: str, size: int, checked: Optional[Checked]
    ) -> Dict[str, Any]:
        file_id = new_id("file-")
        created = self.clock()
        obj = {"id": file_id, "object": "file", "bytes": size, "created_at": int(created),
               "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}  # fmt: skip
        record = {"object": obj, "created": created}  # orders files made in one second
        if checked is not None:
            record.update(requests=checked.requests, urls=sorted(checked.urls))
        write_atomic(staging / "file.json", orjson.dumps(record))
        staging.rename(self.root / file_id)  # the file appears whole, or not at all
        return obj


def _copy_bounded(source: BinaryIO, target: Path, max_bytes: int) -> int:
    size = 0
    with open(target, "wb") as out:
        while True:
            block = source.read(COPY_BLOCK)
            if not block:
                return size
            size += len(block)
            if size > max_bytes:
                raise bad_request(
                    f"the file is larger than {max_bytes} bytes, the most a batch "
                    "input file may hold",
                    "file",
                    "file_too_large",
                )
            out.write(block)


def check_batch_input(path: Path, limits: Limits) -> Checked:
    """Refuse (400, naming the line) a batch input that is not JSON Lines of OpenAI batch
    requests with unique ``custom_id``s, or that holds more than ``limits.max_requests``. What a
    request's body asks is checked later, per line: a bad body gives that line an error."""
    seen: Dict[str, int] = {}
    urls: Set[str] = set()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            line = _request_line(raw, number)
            custom_id = line["custom_id"]
            if custom_id in seen:
                raise bad_request(f"line {number}: custom_id {custom_id!r} repeats line "
                                  f"{seen[custom_id]}; each request needs its own",
                                  "file", "duplicate_custom_id")  # fmt: skip
            seen[custom_id] = number
            urls.add(line["url"])
            if len(seen) > limits.max_requests:
                raise bad_request(
                    f"the file holds more than {limits.max_requests} requests, "
                    "the most one batch may hold",
                    "file",
                    "too_many_requests",
                )
    if not seen:
        raise bad_request("the file holds no requests", "file", "empty_file")
    return Checked(len(seen), urls)


def _request_line(raw: bytes, number: int) -> Dict[str, Any]:
    where = f"line {number}"
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(
            f"{where}: not valid JSON ({e.msg}); a batch input is JSON Lines, "
            "one request object per line",
            "file",
            "invalid_jsonl",
        ) from None
    if not isinstance(line, dict):
        raise bad_request(f"{where}: not a JSON object", "file", "invalid_jsonl")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        raise bad_request(
            f"{where}: 'custom_id' must be a non-empty string", "file", "invalid_custom_id"
        )
    if line.get("method") != "POST":
        raise bad_request(f"{where}: 'method' must be 'POST'", "file", "invalid_method")
    if line.get("url") not in OPENAI_URLS:
        use = " or ".join(sorted(OPENAI_URLS))
        raise bad_request(f"{where}: 'url' must be {use}", "file", "unsupported_url")
    if not isinstance(line.get("body"), dict):
        raise bad_request(f"{where}: 'body' must be an object", "file", "invalid_body")
    return line
