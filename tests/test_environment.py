"""One table (dflash_batch/environment.py) holds every environment variable the package reads,
and only that module touches ``os.environ``: the others ask it. The reference page and
``--help`` are written from the table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dflash_batch import environment
from dflash_batch.errors import SettingError
from tests.runner_fixtures import REPO

PACKAGE = REPO / "dflash_batch"
TABLE = PACKAGE / "environment.py"
# a read or write of the environment: os.environ (and environb), getenv, putenv, unsetenv, or
# ``environ`` imported by name
TOUCH = re.compile(r"\bos\.environb?\b|\b(get|put|unset)env\b|\bfrom os import\b.*\benviron\b")
# a variable the code names: DFLASH_BATCH_*, or any name asked of the table
NAMED = re.compile(r"\bDFLASH_BATCH_[A-Z_]+\b|environment\.get\(\"([A-Z_]+)\"\)")


def scattered_touches(package):
    """``path:line`` of every line outside the table module that touches the environment."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "environment.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if TOUCH.search(line):
                found.append(f"{path.relative_to(package.parent)}:{number}")
    return found


def test_only_the_table_module_touches_the_environment():
    assert scattered_touches(PACKAGE) == [], "read or write it through dflash_batch.environment"
    assert any(TOUCH.search(line) for line in TABLE.read_text().splitlines())  # the one that does


def test_a_scattered_read_is_caught(tmp_path):
    """The check above on a copy of the package with one read added outside the table."""
    copy = tmp_path / "dflash_batch"
    for path in PACKAGE.rglob("*.py"):
        (copy / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (copy / path.relative_to(PACKAGE)).write_text(path.read_text())
    with open(copy / "runner" / "rows.py", "a") as f:
        f.write('\nimport os\nWHERE = os.environ.get("DFLASH_BATCH_HOME")\n')
    with open(copy / "paths.py", "a") as f:
        f.write("\nfrom os import getenv\n")
    assert len(scattered_touches(copy)) == 2
    assert scattered_touches(copy)[0].startswith("dflash_batch/paths.py:")


def test_every_variable_the_code_names_is_in_the_table():
    """Each DFLASH_BATCH_* name in the package or the install script, and each name asked of the
    table, has a row with a group, where it applies, a default and a line of doc."""
    named = set()
    for path in [*PACKAGE.rglob("*.py"), REPO / ".ci" / "install"]:
        for match in NAMED.finditer(path.read_text()):
            named.add(match.group(1) or match.group(0))
    assert {"DFLASH_BATCH_HOME", "DFLASH_BATCH_LEASE_S", "CUDA_VISIBLE_DEVICES", "CXX"} <= named
    assert named <= set(environment.VARIABLES), named - set(environment.VARIABLES)
    for variable in environment.VARIABLES.values():
        assert (
            variable.group in environment.GROUPS
            and variable.applies
            and variable.default
            and variable.doc
        )
        assert "|" not in variable.default + variable.applies + variable.doc  # a table cell each
        if variable.literal:  # a default that is a value passes its own check
            variable.read(variable.name, variable.default)


def test_the_reference_documents_every_variable_by_group():
    """docs/configuration.md is the table as it stands (regenerate: ``python -m
    dflash_batch.environment > docs/configuration.md``): a row for every variable, under its
    group's heading."""
    text = (REPO / environment.REFERENCE).read_text()
    assert text == environment.markdown(), "docs/configuration.md is stale: regenerate it"
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    titles = [section.splitlines()[0] for section in sections]
    assert titles == list(environment.GROUPS.values())
    for section, key in zip(sections, environment.GROUPS):
        rows = re.findall(r"^\| `([A-Z_0-9]+)` \|", section, flags=re.M)
        assert rows == [v.name for v in environment.group(key)]
    assert sum(map(len, map(environment.group, environment.GROUPS))) == len(environment.VARIABLES)


def test_a_value_is_read_checked_and_unset_is_none(monkeypatch):
    monkeypatch.delenv("DFLASH_BATCH_REDIS_URL", raising=False)
    assert environment.get("DFLASH_BATCH_REDIS_URL") is None
    monkeypatch.delenv("DFLASH_BATCH_LEASE_S", raising=False)
    assert environment.get("DFLASH_BATCH_LEASE_S") == 30  # the row's default, a value
    monkeypatch.setenv("DFLASH_BATCH_LEASE_S", "")
    assert environment.get("DFLASH_BATCH_LEASE_S") == 30  # empty: unset in effect
    monkeypatch.setenv("DFLASH_BATCH_LEASE_S", "4.5")
    assert environment.get("DFLASH_BATCH_LEASE_S") == 4.5  # read when asked, not at import
    for name, bad in [
        ("DFLASH_BATCH_LEASE_S", "0"),
        ("DFLASH_BATCH_MEMORY_GB", "inf"),
        ("DFLASH_BATCH_DRAFTS", "forest"),
        ("DFLASH_BATCH_KERNEL_CHECK", "yes"),
    ]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(SettingError, match=name):
            environment.get(name)
        with pytest.raises(SettingError, match=name):
            environment.check()
        monkeypatch.delenv(name)
    environment.check()
    with pytest.raises(KeyError):
        environment.get("DFLASH_BATCH_NO_SUCH")  # every read is of a declared variable


def test_writes_are_declared_and_a_child_gets_a_copy(monkeypatch):
    monkeypatch.delenv("DFLASH_BATCH_REDIS_URL", raising=False)
    with pytest.raises(KeyError):
        environment.export(DFLASH_BATCH_NO_SUCH="x")
    assert "DFLASH_BATCH_NO_SUCH" not in os.environ
    monkeypatch.setenv("DFLASH_BATCH_REDIS_URL", "")  # monkeypatch restores what export writes
    environment.export(DFLASH_BATCH_REDIS_URL="redis://localhost:6379/0")
    assert environment.get("DFLASH_BATCH_REDIS_URL") == "redis://localhost:6379/0"
    child = environment.child(PYTHONPATH="/somewhere")
    assert child["PYTHONPATH"] == "/somewhere" and child["DFLASH_BATCH_REDIS_URL"].startswith(
        "redis:"
    )
    assert os.environ.get("PYTHONPATH") != "/somewhere"


def test_the_routing_modes_are_declared_by_their_rows():
    from dflash_batch.engine.ops import switch

    for route in switch.SWITCHES:
        row = environment.VARIABLES[route.env]
        assert tuple(route.modes) == row.choices and (route.cuda, route.elsewhere) == row.by_backend
        assert {route.cuda, route.elsewhere} <= set(
            row.choices
        ) and f"`EngineConfig.{route.field}`" in row.doc


def test_help_lists_every_variable_without_loading_the_engine():
    """``dflash-batch --help`` in a process that could not import MLX: the table is plain Python."""
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx_lm'] = None\n"
        "from dflash_batch.cli import main\nmain(['--help'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for variable in environment.VARIABLES.values():
        assert f"{variable.name} (default: {variable.default})" in out.stdout
    assert all(title.replace("`", "") in out.stdout for title in environment.GROUPS.values())
