"""The engine's environment variables in one table (name, default, one line of doc, check),
checked together: a bad value is refused before a job starts (``SettingError``, naming the
variable) rather than failing the job when first read. Each variable supplies a default only;
``EngineConfig``'s fields, set in code, take precedence. The table also writes the configuration
reference (``markdown``: docs/configuration.md) and the CLI's ``--help`` (``epilog``)."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Tuple

from ..errors import SettingError
from ..paths import CACHE_ENV
from . import memory
from .ops import switch
from .ops.blas import BLAS_ENV, PTX_ENV
from .ops.kernels import selfcheck


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str
    check: Callable[[], object]  # raises SettingError for a value that cannot be used


def _memory() -> None:
    if os.environ.get(memory.ENV_LIMIT):
        memory.limit_bytes(os.environ[memory.ENV_LIMIT])


def _cache() -> None:
    cache = os.environ.get(CACHE_ENV)
    if cache and Path(cache).expanduser().exists() and not Path(cache).expanduser().is_dir():
        raise SettingError(f"{CACHE_ENV}={cache!r}: not a folder")


def _routing(made: switch.Switch) -> Variable:
    default = f"{made.cuda} on CUDA, {made.elsewhere} elsewhere"
    doc = f"{made.doc}; one of {', '.join(made.modes)} (`EngineConfig.{made.field}` in code)"
    return Variable(made.env, default, doc, made.default)


def variables() -> Tuple[Variable, ...]:
    """Every engine variable: the routing switches, then the rest."""
    return (*map(_routing, switch.SWITCHES),
            Variable(selfcheck.ENV, "1", "0 skips the GPU kernels' self-check", selfcheck.enabled),
            Variable(memory.ENV_LIMIT, "the device's memory", "gigabytes the engine may use",
                     _memory),
            Variable(CACHE_ENV, "the platform's cache folder",
                     "where converted models and built ops live", _cache),
            Variable(BLAS_ENV, "a system OpenBLAS",
                     "a CBLAS .so preloaded for MLX's CPU backend, or none", lambda: None),
            Variable(PTX_ENV, "the model cache's mlx-kernels folder",
                     "MLX's own: where its CUDA backend keeps compiled kernels", lambda: None))


def check() -> None:
    """Raise ``SettingError`` for the first engine variable whose value cannot be used."""
    for variable in variables():
        variable.check()


REFERENCE = "docs/configuration.md"  # written by ``markdown``; a test checks it is current


def markdown() -> str:
    """The configuration reference (``REFERENCE``): every variable, its default and its doc."""
    lines = [
        "# Configuration",
        "",
        "The engine's environment variables. Each supplies a default only: the same setting given in",
        "code (`load_engine(...)`, `EngineConfig`) or on the command line takes precedence. A value the",
        "engine cannot use is refused, naming the variable, before a job starts.",
        "",
        "Written from the one table in `dflash_batch/engine/settings.py`; regenerate with",
        "`python -m dflash_batch.engine.settings > docs/configuration.md` (a test checks it is current).",
        "",
        "| Variable | Default | What it sets |",
        "|---|---|---|",
    ]
    lines += [f"| `{v.name}` | {v.default} | {v.doc} |" for v in variables()]
    return "\n".join(lines) + "\n"


def epilog() -> str:
    """The variables as the CLI's ``--help`` lists them."""
    lines = ["engine environment variables (defaults only: settings given in code or as flags win;",
             f"{REFERENCE}):"]
    for v in variables():
        lines.append(f"  {v.name} (default: {v.default})")
        lines += textwrap.wrap(v.doc.replace("`", ""), 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
