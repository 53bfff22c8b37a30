"""pyproject.toml as today's setuptools reads it without deprecation warnings: the licence an
SPDX expression (a TOML table is deprecated), with a build backend new enough to read one."""

from __future__ import annotations

import re

import pytest

from tests.runner_fixtures import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_licence_is_an_spdx_string():
    assert pyproject()["project"]["license"] == "Apache-2.0"


def test_the_build_backend_reads_spdx_licences():
    """setuptools reads ``project.license`` as a string from version 77 on."""
    requires = pyproject()["build-system"]["requires"]
    (setuptools,) = [r for r in requires if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert floor and int(floor.group(1)) >= 77, setuptools


def test_the_package_carries_no_diary():
    """Package data is code and assets: the only prose a wheel ships is each asset's short
    README; training diaries and dated results live in docs/results/."""
    texts = [p for p in (REPO / "dflash_batch").rglob("*") if p.suffix in (".md", ".log", ".jsonl")]
    assert all(p.name == "README.md" and p.stat().st_size < 8000 for p in texts), texts
    assert (REPO / "dflash_batch/assets/drafters/smollm2-135m-instruct/README.md").exists()
