"""Value checks shared by job specs, input rows and the command line.

Each check returns the value it accepts, or raises ``BadValue`` saying what is wrong without
naming the key: the caller knows the key (and the file or line) and puts it in front.

* numbers read from a job or a row must be finite (``finite_number``, ``temperature``);
* a name that becomes a file or folder name must be one plain name (``plain_name``), and a path
  built from one stays inside its root, symlinks included (``path_under``);
* a hub revision must be a ref name git would accept (``revision``), since the hub cache
  stores refs as files;
* chat messages are checked by one rule for the runner and the engine (``chat_messages``).
* a JSON value that something recursive walks (``json.dumps``, a deep copy, a grammar compiler)
  nests at most ``MAX_NESTING`` levels (``nesting``), checked without recursion.
* a file a flag or a spec names is read only if it is a regular file of bounded size
  (``small_file_text``): never a FIFO that blocks or a device that never ends.
"""

from __future__ import annotations

import math
import os
import re
import stat
from pathlib import Path
from typing import Dict, List, Optional

from .errors import BadValue

# 0 is greedy; a positive temperature must be at least this. Far below it logits / t overflow
# float32 (inf) and the sample is no longer the target's; near it sampling is greedy in effect.
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed
NAME_BYTES = 200  # file systems allow 255 bytes per name; room for a suffix
# far above any real schema or settings, far below Python's recursion limit (about 1000) and
# llguidance's JSON parser limit (128)
MAX_NESTING = 100
_PLAIN = re.compile(r"\w(?:[\w .-]*[\w.-])?")
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|//|@\{")
# OpenAI's roles; "developer" is read as "system"
ROLES = ("assistant", "developer", "system", "tool", "user")


def show(value) -> str:
    """A value as messages show it: repr, shortened."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def json_type(value) -> str:
    """A JSON value's kind as messages name it: "an object", "a list", "null"..."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def nesting(value, limit: int = MAX_NESTING):
    """``value`` if its lists and objects nest at most ``limit`` deep. Walked level by level, not
    recursively, so a deeper value (or a YAML alias that contains itself) is refused before any
    recursive walk of it raises ``RecursionError``."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for x in level for v in _children(x)]
        if not level:
            return value
    raise BadValue(f"nests deeper than {limit} levels of lists and objects")


def _children(value):
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, (list, tuple)) else ()


def finite_number(value, minimum: Optional[float] = None) -> float:
    """``value`` as a float; refused unless it is an int or float, finite, and >= ``minimum``."""
    floor = "" if minimum is None else f" >= {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadValue(f"must be a number{floor}, got {show(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise BadValue(f"must be a finite number{floor}, got {show(value)}") from None
    if not math.isfinite(number):
        raise BadValue(f"must be a finite number{floor}, got {value!r}")
    if minimum is not None and number < minimum:
        raise BadValue(f"must be a number{floor}, got {show(value)}")
    return number


def temperature(value) -> float:
    """0 (greedy) or a finite number >= ``MIN_TEMPERATURE``."""
    number = finite_number(value, 0)
    if 0 < number < MIN_TEMPERATURE:
        raise BadValue(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r}")
    return number


def plain_name(value) -> str:
    """``value`` if it can serve as one file or folder name as it is: letters, digits, '_', '-',
    '.' and inner spaces, starting with a letter, digit or '_' (so never '.', '..' or hidden),
    no separator, at most ``NAME_BYTES`` bytes."""
    if not isinstance(value, str):
        raise BadValue(f"must be a string, got {show(value)}")
    if not _PLAIN.fullmatch(value) or len(value.encode()) > NAME_BYTES:
        raise BadValue(
            "must be a plain name: letters, digits, '_', '-', '.' and inner spaces, starting with a "
            f"letter, digit or '_', no '/', at most {NAME_BYTES} bytes; got {show(value)}"
        )
    return value


def slug(text: str, limit: int = 40) -> str:
    """``text`` made a plain ASCII name: runs of other characters become '-'; '' if nothing is left."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:limit].rstrip("-.")


def path_under(root: Path, name: str) -> Path:
    """``root / name`` for a plain ``name``; refused when the name is not plain, or when that path
    already exists as a symlink (or through one) to somewhere outside ``root``."""
    plain_name(name)
    root = Path(root).resolve()
    path = root / name
    target = path.resolve()
    if target.parent != root:
        raise BadValue(f"{path} leads to {target}, outside {root}")
    return path


def revision(value) -> str:
    """A hub revision (branch, tag, commit, ``refs/pr/1``): a ref name git would accept."""
    if not isinstance(value, str):
        raise BadValue(f"must be a string, got {show(value)}")
    parts = value.split("/")
    if (
        not value
        or _REF_FORBIDDEN.search(value)
        or value.startswith("/")
        or value.endswith(("/", ".", ".lock"))
        or value == "@"
        or any(not p or p.startswith(".") for p in parts)
    ):
        raise BadValue(f"must be a branch, tag or commit name (as git allows), got {show(value)}")
    return value


def chat_messages(value, name: str = "messages") -> List[Dict[str, str]]:
    """Chat messages as the chat template takes them: a non-empty list of objects with a role of
    ``ROLES`` ("developer" becomes "system") and string content, or OpenAI content parts whose
    text parts are joined; some user or assistant content not blank. Messages name the fault
    from ``name``: "messages[1].content[0].text must be a string, got int"."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else json_type(value)
        raise BadValue(f"{name!r} must be a non-empty list of messages, got {got}")
    out = []
    for i, message in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(message, dict):
            got = json_type(message)
            raise BadValue(f"{at} must be an object with 'role' and 'content', got {got}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadValue(f"{at}.role must be one of {', '.join(ROLES)}, got {show(role)}")
        content = message.get("content")
        if isinstance(content, list):
            content = _content_parts(content, f"{at}.content")
        if not isinstance(content, str):
            got = json_type(content)
            raise BadValue(f"{at}.content must be a string or a list of text parts, got {got}")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"].strip() for m in out if m["role"] != "system"):
        raise BadValue(f"{name!r} has no non-empty user or assistant content")
    return out


def _content_parts(parts: list, at: str) -> str:
    """OpenAI content parts joined: only text parts; an image or audio part would be dropped
    unseen, so any other kind is refused."""
    texts = []
    for j, part in enumerate(parts):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            got = json_type(part)
            raise BadValue(f"{where} must be an object {{'type': 'text', 'text': ...}}, got {got}")
        if part.get("type") != "text":
            got = show(part.get("type"))
            raise BadValue(f"{where}.type must be 'text' (the only kind supported), got {got}")
        if not isinstance(part.get("text"), str):
            raise BadValue(f"{where}.text must be a string, got {json_type(part.get('text'))}")
        texts.append(part["text"])
    return "".join(texts)


def small_file_text(path, limit: int) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes. Checked on the open
    descriptor, so a FIFO, a device (/dev/zero), a folder or an oversized file is refused at
    once: opened without blocking, never read."""
    try:
        fd = os.open(os.fspath(Path(path).expanduser()), os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BadValue(f"{path}: no such file") from None
    except OSError as e:
        raise BadValue(f"{path}: cannot open: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadValue(f"{path}: not a regular file")
        raise BadValue(f"{path}: {info.st_size} bytes, more than the {limit} allowed")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)  # a file that grew since fstat is still bounded
        except OSError as e:
            raise BadValue(f"{path}: cannot read: {e.strerror or e}") from None
    if len(data) > limit:
        raise BadValue(f"{path}: more than the {limit} bytes allowed")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadValue(f"{path}: not UTF-8 text ({e})") from None
