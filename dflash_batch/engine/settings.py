"""The engine's environment variables: a view of the package's one table
(dflash_batch/environment.py), which reads, checks and documents every variable. ``check``
refuses a bad value before a job starts (``SettingError``, naming the variable) rather than
failing the job when first read. ``markdown`` and ``epilog`` write the whole table:
docs/configuration.md and the CLI's ``--help``."""

from __future__ import annotations

from typing import Tuple

from .. import environment
from ..environment import REFERENCE, Variable, epilog, markdown


def variables() -> Tuple[Variable, ...]:
    """Every engine variable: the routing switches, then the rest."""
    return environment.group("engine")


def check() -> None:
    """Raise ``SettingError`` for the first engine variable whose value cannot be used."""
    environment.check(variables())


__all__ = ["REFERENCE", "Variable", "check", "epilog", "markdown", "variables"]

if __name__ == "__main__":
    print(markdown(), end="")
