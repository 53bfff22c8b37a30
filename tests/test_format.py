"""The code keeps one format and one import order: ruff's formatter and its isort rule, set in
pyproject.toml's ``[tool.ruff]`` (ruff is pinned in the test extra, so every machine formats
alike). The command that applies them is ``APPLY`` below (docs/README.md, "Formatting")."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.runner_fixtures import REPO

PATHS = ("dflash_batch", "tests", "benchmarks")
APPLY = (
    "python -m ruff format dflash_batch tests benchmarks"
    " && python -m ruff check --select I --fix dflash_batch tests benchmarks"
)
CONFIG = REPO / "pyproject.toml"


def ruff(subcommand: str, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    """The venv's ruff, leaving no cache in the checkout."""
    command = [sys.executable, "-m", "ruff", subcommand, "--no-cache", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


def tracked_python_files() -> int | None:
    """How many .py files git tracks under PATHS (None outside a git checkout)."""
    try:
        command = ["git", "ls-files", "--", *PATHS]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    if done.returncode != 0:
        return None
    return sum(1 for name in done.stdout.splitlines() if name.endswith(".py"))


def test_the_code_is_formatted():
    done = ruff("format", "--check", *PATHS)
    assert done.returncode == 0, f"{done.stdout[-4000:]}{done.stderr}\nto format: {APPLY}"
    # every tracked file was looked at, none left out by an exclude
    checked = int(re.search(r"(\d+) files? already formatted", done.stdout).group(1))
    tracked = tracked_python_files()
    assert tracked is None or checked >= tracked, (checked, tracked)


def test_imports_are_in_isort_order():
    done = ruff("check", "--select", "I", "--output-format", "concise", *PATHS)
    assert done.returncode == 0, f"{done.stdout[-4000:]}{done.stderr}\nto order: {APPLY}"


UNFORMATTED = """import os
def f(a,b):
    return {'a':a,'b':b}
"""
MISORDERED = """import sys
import os

from dflash_batch import errors
import mlx.core as mx
import dflash_batch.engine
"""
# 100 characters: one line at this project's length (100), two at black's (88)
FITS = 'value = ("' + "x" * 40 + '", "' + "y" * 44 + '")\n'


def test_the_checks_catch_an_unformatted_file_and_misordered_imports(tmp_path):
    """Negative controls, with the project's own settings: the two checks above can fail."""
    assert len(FITS.rstrip("\n")) == 100
    for name, text in (("bad.py", UNFORMATTED), ("order.py", MISORDERED), ("fits.py", FITS)):
        (tmp_path / name).write_text(text)
    fmt = ("format", "--check", "--config", str(CONFIG))
    order = ("check", "--select", "I", "--config", str(CONFIG))
    assert ruff(*fmt, "bad.py", cwd=tmp_path).returncode == 1
    assert ruff(*fmt, "fits.py", cwd=tmp_path).returncode == 0
    assert ruff(*order, "order.py", cwd=tmp_path).returncode == 1
    assert ruff(*order, "--fix", "order.py", cwd=tmp_path).returncode == 0
    # the engine before mlx (importing it preloads the BLAS), the rest of the package after
    fixed = (tmp_path / "order.py").read_text()
    blocks = [
        "import os\nimport sys",
        "import dflash_batch.engine",
        "import mlx.core as mx",
        "from dflash_batch import errors",
    ]
    assert fixed == "\n\n".join(blocks) + "\n"
