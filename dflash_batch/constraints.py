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
"""

from __future__ import annotations

import functools
import json
from typing import Any, Optional

from .checks import BadValue, json_type, show
from .extras import install_hint

TYPES = ("json_schema", "json_object", "regex", "grammar", "text")


def grammar(response_format: Any) -> Optional[str]:
    """The llguidance grammar of a ``response_format`` (None: unconstrained); raises ``BadValue``
    saying what is wrong (an unknown type, a missing field, a schema llguidance cannot compile)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise BadValue(f"must be an object, got {json_type(response_format)}")
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


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str) -> str:
    """Compile and validate (cached: the rows of a job usually share one schema)."""
    try:
        import llguidance
    except ImportError:
        raise BadValue(f"needs llguidance: {install_hint('structured')}") from None
    try:
        if kind == "json":
            # compact JSON (no free whitespace): a model cannot pad its output with blank runs
            out = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
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
