"""The import contract in pyproject.toml ([tool.importlinter]): the runner never imports MLX or the
engine, the engine never imports the runner. CI installs import-linter with the test extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runner_fixtures import REPO


def test_import_contracts_are_kept():
    pytest.importorskip("importlinter")
    program = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([str(program)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
