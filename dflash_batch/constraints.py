"""Structured output: a ``response_format`` checked and turned into an llguidance grammar.

No MLX here: the runner checks every row's (and the job's) ``response_format`` before any
generation, and the engine builds its matchers from the grammar this returns.

Accepted forms (the first two are OpenAI's):

* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: JSON valid
  against the schema;
* ``{"type": "json_object"}``: any JSON object;
* ``{"type": "regex", "regex": "..."}``: text matching the regular expression;
* ``{"type": "grammar", "grammar": "..."}``: a Lark grammar (llguidance's dialect);
* ``{"type": "text"}``: no constraint.

llguidance (the optional ``structured`` extra) does the parsing: a grammar library kept by the
people who run it in production servers, small (one Rust wheel, no torch), with masks computed
along a draft for speculative decoding and rollback (docs/sampling.md).

Any row can carry a grammar, so each one is compiled and validated first in a helper process
(``_Helper``): llguidance overflows its stack on some (a chain of thousands of rules) and dies
of SIGSEGV, which no Python code can catch. There a crash costs the helper alone and becomes
that row's error. The helper checks on a thread with half the stack this process's threads
get (building a matcher takes about as much as validating), so what passes there has room to
spare in the engine; a chain of about 1,200 rules passes, 1,500 do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Tuple

from . import environment
from .checks import BadValue, json_type, nesting, show
from .extras import install_hint

TYPES = ("json_schema", "json_object", "regex", "grammar", "text")
MAX_CHARS = 1_000_000  # of a regex, grammar or schema: far above real ones
USUAL_STACK = 8 * 2**20  # bytes of stack a thread gets where RLIMIT_STACK is unlimited
CHECK_TIMEOUT_S = 60.0  # a grammar that takes longer to compile is refused
CACHED = 256  # outcomes kept (least recently used dropped)
_OUTCOMES: "OrderedDict[str, Tuple[Optional[str], Optional[str]]]" = OrderedDict()


def grammar(response_format: Any) -> Optional[str]:
    """The llguidance grammar of a ``response_format`` (None: unconstrained); raises ``BadValue``
    saying what is wrong (an unknown type, a missing field, a schema llguidance cannot compile)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise BadValue(f"must be an object, got {json_type(response_format)}")
    nesting(response_format)  # before json.dumps below walks it recursively
    kind = response_format.get("type")
    if kind not in TYPES:
        raise BadValue(f"'type' must be one of {', '.join(TYPES)}, got {show(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compile("json", json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadValue("'json_schema' must be an object with a 'schema' object")
        return _compile("json", json.dumps(spec["schema"], sort_keys=True))
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise BadValue(f"'{kind}' must be a non-empty string, got {show(text)}")
    return _compile(kind, text)


def _compile(kind: str, text: str) -> str:
    """Compile and validate in the helper process; raises ``BadValue``."""
    if len(text) > MAX_CHARS:
        raise BadValue(f"is {len(text)} characters long; at most {MAX_CHARS}")
    _require_library()
    grammar, error = _checked(kind, text)
    if grammar is None:
        raise BadValue(error or "cannot be compiled")
    return grammar


def _require_library() -> None:
    """Where llguidance is missing, say how to install it here (the helper would only fail)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise BadValue(f"needs llguidance: {install_hint('structured')}") from None


def _checked(kind: str, text: str) -> Tuple[Optional[str], Optional[str]]:
    """(grammar, None) or (None, why not), kept by the grammar's hash: the rows of a job usually
    share one schema, and a grammar that crashed the helper is not tried again. A helper that
    could not run at all is not the grammar's fault: that answer is not kept."""
    key = hashlib.sha256(f"{kind}\0{text}".encode()).hexdigest()
    if key in _OUTCOMES:
        _OUTCOMES.move_to_end(key)
        return _OUTCOMES[key]
    grammar, error, lasting = _HELPER.check(kind, text)
    if lasting:
        _OUTCOMES[key] = (grammar, error)
        if len(_OUTCOMES) > CACHED:
            _OUTCOMES.popitem(last=False)
    return grammar, error


def compile_here(kind: str, text: str) -> str:
    """Compile and validate in this process (the helper's work); raises ``BadValue``."""
    _require_library()
    import llguidance

    try:
        if kind == "json":
            # compact JSON (no free whitespace): a model cannot pad its output with blank runs
            out = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            out = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            out = llguidance.LLMatcher.grammar_from_lark(text)
    except Exception as e:  # llguidance raises ValueError / RuntimeError on a bad schema
        raise BadValue(f"cannot be compiled: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(out)
    if error:
        raise BadValue(f"cannot be compiled: {error}")
    return out


class _Helper:
    """The helper process, started on first use and again after a crash; one check at a time."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.pid = os.getpid()  # the process that started ``proc``
        self.lock = threading.Lock()

    def check(self, kind: str, text: str) -> Tuple[Optional[str], Optional[str], bool]:
        """(grammar, None) or (None, why not), and whether that answer is the grammar's own."""
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None or self.pid != os.getpid():
                    self.proc, self.pid = _start_helper(), os.getpid()  # a fork starts its own
            except OSError as e:  # no process to be had (out of memory, too many processes)
                return None, f"cannot be checked: no grammar check process: {e}", False
            try:
                self.proc.stdin.write(json.dumps([kind, text]).encode() + b"\n")
                self.proc.stdin.flush()
                ready, _, _ = select.select([self.proc.stdout], [], [], CHECK_TIMEOUT_S)
                line = self.proc.stdout.readline() if ready else None
            except OSError:  # the helper died before it read the request
                line = b""
            if line and line.endswith(b"\n"):  # a whole answer (a crash may cut one short)
                answer = json.loads(line)
                return answer.get("grammar"), answer.get("error"), True
            return self._failed(line is None)

    def _failed(self, timed_out: bool) -> Tuple[None, str, bool]:
        """Why the helper gave no answer; it is stopped, and the next check starts a new one."""
        proc, self.proc = self.proc, None
        proc.kill()
        code = proc.wait()
        if timed_out:
            return None, f"cannot be compiled: took longer than {CHECK_TIMEOUT_S:g} s", True
        if code >= 0:  # not a crash: the helper could not run (a missing llguidance it reports)
            return None, f"cannot be checked: the grammar check process exited ({code})", False
        why = (
            f"cannot be compiled: the grammar library crashed on it ({_signal(-code)}); a chain "
            "of rules or a nesting this deep is beyond what it can check"
        )
        return None, why, True


def _signal(number: int) -> str:
    try:
        return f"signal {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def _start_helper() -> subprocess.Popen:
    # the helper imports this package from where this process found it
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, environment.get("PYTHONPATH")) if p)
    # its own session: a Ctrl-C meant for this process does not stop it mid-check
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_batch.constraints", str(_check_stack())],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=environment.child(PYTHONPATH=path), start_new_session=True,
    )  # fmt: skip


def _check_stack() -> int:
    """Half the stack this process's threads get (its stack limit, at most ``USUAL_STACK``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    usual = USUAL_STACK if soft == resource.RLIM_INFINITY else min(soft, USUAL_STACK)
    return usual // 2


def _serve(stack: int) -> None:
    """The helper's loop: ``[kind, text]`` a line in; ``{"grammar"}`` or ``{"error"}`` out."""
    threading.stack_size(stack)
    for line in sys.stdin.buffer:
        kind, text = json.loads(line)
        answer = {}

        def work():
            try:
                answer["grammar"] = compile_here(kind, text)
            except BadValue as e:
                answer["error"] = str(e)
            except Exception as e:  # whatever else llguidance raises is this grammar's error too
                answer["error"] = f"cannot be compiled: {e}"

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


_HELPER = _Helper()

if __name__ == "__main__":
    _serve(int(sys.argv[1]))
