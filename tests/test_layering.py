"""The import contracts in pyproject.toml ([tool.importlinter]): MLX only in engine/ and
training/; the runner never imports MLX or the engine; the engine never imports the runner;
inside the engine the loop stands on the models and the models on the ops, with no circle. CI
installs import-linter with the test extra. And the runner's fake-engine tests pass with MLX
blocked, so the runner can be tested and deployed without it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.runner_fixtures import REPO

CONTRACTS = 5


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    program = Path(sys.executable).with_name("lint-imports")
    assert program.exists(), "import-linter is in the test extra: pip install -e '.[test]'"
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [str(program), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_import_contracts_are_kept():
    out = lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{CONTRACTS} kept, 0 broken" in out.stdout


def test_import_contracts_catch_violations(tmp_path):
    """A copy of the package with one violation of each contract: all of them are reported."""
    shutil.copytree(
        REPO / "dflash_batch",
        tmp_path / "dflash_batch",
        ignore=shutil.ignore_patterns("assets", "__pycache__"),
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    pkg = tmp_path / "dflash_batch"
    with open(pkg / "api.py", "a") as f:
        f.write("\nimport mlx.core  # noqa\n")  # MLX outside engine/ and training/
    with open(pkg / "runner" / "rows.py", "a") as f:
        f.write("\nfrom ..engine import memory  # noqa\n")  # the runner on the engine
    with open(pkg / "engine" / "stopping.py", "a") as f:
        f.write("\nfrom ..runner import jobs  # noqa\n")  # the engine on the runner
        f.write("from . import engine  # noqa\n")  # a circle: the engine imports stopping
    with open(pkg / "engine" / "ops" / "device.py", "a") as f:
        f.write("\nfrom .. import sampling  # noqa\n")  # the ops on the decoding loop
    out = lint_imports(tmp_path)
    assert out.returncode != 0 and f"0 kept, {CONTRACTS} broken" in out.stdout, (
        out.stdout + out.stderr
    )


BLOCK_MLX = '''
import sys


class NoMLX:
    """Refuses mlx and mlx_lm, as a machine without them would."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mlx", "mlx_lm"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: runner tests without MLX)", name=name)
        return None


sys.meta_path.insert(0, NoMLX())
'''


def test_runner_tests_pass_without_mlx(tmp_path):
    """The runner tests not marked ``mlx`` (tests/conftest.py) run with MLX blocked in this
    process and in every ``dflash-batch`` process they start, and pass."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_MLX)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    check = subprocess.run(
        [sys.executable, "-c", "import mlx.core"], env=env, capture_output=True, text=True
    )
    assert check.returncode != 0 and "blocked" in check.stderr  # the blocker works
    runner_tests = sorted(str(p) for p in (REPO / "tests").glob("test_runner_*.py"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not mlx", *runner_tests],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    summary = out.stdout.strip().splitlines()[-1]  # "99 passed, 17 deselected in 56.7s"
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 30 and "skipped" not in summary, (
        tail
    )
