"""How to install an optional extra. dflash-batch is not on a package index: it is installed
from its clone, so a hint names the clone's path, not the package's name. Plain Python: the
runner and the shared plain-data modules import it."""

from __future__ import annotations

from pathlib import Path

PLACEHOLDER = "/path/to/dflash-batch"


def clone_dir() -> str:
    """The clone this package runs from (an editable install), else a placeholder to fill in."""
    root = Path(__file__).resolve().parent.parent
    return str(root) if (root / "pyproject.toml").is_file() else PLACEHOLDER


def install_hint(extra: str) -> str:
    """Both ways to add ``extra``: the clone's own .venv, and another app's environment."""
    return (f"install the {extra!r} extra from the clone (dflash-batch is not on a package index): "
            f"in the clone, .venv/bin/pip install -e '.[{extra}]'; in another environment, "
            f"pip install -e '{clone_dir()}[{extra}]'")  # fmt: skip
