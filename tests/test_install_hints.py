"""Install hints name the clone: dflash-batch is on no package index, so `pip install
'dflash-batch[extra]'` cannot work. Each hint says how to add the extra in the clone and from
another application's environment. No MLX."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dflash_batch import constraints
from dflash_batch.checks import BadValue
from dflash_batch.runner import queue
from dflash_batch.runner.spec import SpecError

REPO = Path(__file__).resolve().parents[1]
INDEX_HINT = re.compile(r"pip install\s+['\"]?dflash-batch\b")  # the package by name: from an index


def assert_clone_hint(message: str, extra: str) -> None:
    assert f".venv/bin/pip install -e '.[{extra}]'" in message
    assert f"pip install -e '{REPO}[{extra}]'" in message  # this clone, for another environment
    assert not INDEX_HINT.search(message)


def test_structured_output_without_llguidance_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(BadValue) as caught:
        constraints.grammar({"type": "regex", "regex": "[ab]+ hint test"})
    assert "needs llguidance" in str(caught.value)
    assert_clone_hint(str(caught.value), "structured")


def test_a_redis_queue_without_the_client_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(SpecError) as caught:
        queue.redis_huey("redis://localhost:6379/0")
    assert_clone_hint(str(caught.value), "redis")


def test_no_message_or_doc_tells_to_install_the_package_from_an_index():
    files = [
        REPO / "README.md",
        *(REPO / "docs").rglob("*.md"),
        *(REPO / "docker").rglob("*"),
        *(REPO / "dflash_batch").rglob("*.py"),
        *(REPO / "examples").glob("*.py"),
        *(REPO / "benchmarks").rglob("*.py"),
    ]
    found = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in files if p.is_file()
             for m in INDEX_HINT.finditer(p.read_text(errors="replace"))]  # fmt: skip
    assert found == []
