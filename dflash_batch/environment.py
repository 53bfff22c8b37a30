"""Every environment variable the package reads, in one table (``VARIABLES``: name, default,
where it applies, one line of doc, a check), and the one module that touches ``os.environ``.

Library code asks ``get(name)``: the value, checked (``SettingError`` naming the variable), or
where unset or empty the row's default when that is a value (else None). No other module reads
the environment (a test greps the package for it). A variable supplies a default only: the same setting given in code (``load_engine(...)``,
``EngineConfig``) or as a flag takes precedence. ``check`` refuses a value that cannot be used
before a job starts rather than when it is first read.

Writing the environment is an act, done here too and only for what runs after it:
- ``export``: the CLI passes ``--home`` and ``--redis`` on as DFLASH_BATCH_HOME and
  DFLASH_BATCH_REDIS_URL; ``worker --device`` sets CUDA_VISIBLE_DEVICES before the backend
  loads; the engine points MLX_PTX_CACHE_DIR at the model cache where it is unset.
- ``child``: the environment a child process is started with (the grammar helper's PYTHONPATH).

The table also writes the configuration reference (``markdown``: docs/configuration.md) and
the CLI's ``--help`` (``epilog``). Standard library only, at the bottom of the import graph:
everything may ask it, from the runner to the engine's lowest floor."""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from .errors import SettingError

Read = Callable[[str, str], Any]  # (name, text set) -> the value; raises SettingError


def _text(name: str, text: str) -> str:
    return text


def _path(name: str, text: str) -> Path:
    return Path(text).expanduser()


def _folder(name: str, text: str) -> Path:
    """A path that is a folder or does not exist yet."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise SettingError(f"{name}={text!r}: not a folder")
    return path


def _one_of(*choices: str) -> Read:
    def read(name: str, text: str) -> str:
        if text not in choices:
            raise SettingError(f"{name}={text!r}: expected one of {choices}")
        return text

    return read


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # fails every comparison below


def _seconds(name: str, text: str) -> float:
    value = _float(text)
    if not 1 <= value <= 86400:
        raise SettingError(f"${name} must be a number of seconds in [1, 86400], got {text!r}")
    return value


def _gigabytes(name: str, text: str) -> float:
    value = _float(text)
    if not 0 < value < math.inf:
        raise SettingError(f"{name}={text!r}: expected a number of gigabytes > 0")
    return value


@dataclass(frozen=True)
class Variable:
    name: str
    group: str  # a key of GROUPS
    applies: str  # where it applies: the commands or backends that read it
    default: str  # what holds where it is unset, as the reference shows it
    doc: str
    read: Read = _text
    literal: bool = False  # ``default`` is a value: ``get`` reads it where the variable is unset
    choices: Tuple[str, ...] = ()  # a routing mode's choices ...
    by_backend: Tuple[str, ...] = ()  # ... and its default (on CUDA, elsewhere)


GROUPS = {
    "runner": "Jobs, the queue and the server",
    "engine": "The engine",
    "platform": "Standard variables the package honours",
    "install": "Installing (read by `.ci/install`, not by the package)",
}


def _route(
    name: str,
    field: str,
    choices: Tuple[str, ...],
    cuda: str,
    elsewhere: str,
    doc: str,
    applies: str = "all backends",
) -> Variable:
    """A routing mode's variable (engine/ops/switch.py declares the mode from it)."""
    return Variable(
        name,
        "engine",
        applies,
        f"{cuda} on CUDA, {elsewhere} elsewhere",
        f"{doc}; one of {', '.join(choices)} (`EngineConfig.{field}` in code)",
        _one_of(*choices),
        choices=choices,
        by_backend=(cuda, elsewhere),
    )


_TABLE = (
    Variable(
        "DFLASH_BATCH_HOME",
        "runner",
        "every command",
        "$XDG_DATA_HOME/dflash-batch (macOS: ~/Library/Application Support/dflash-batch)",
        "the job home: job records, the queue and results (`--home`)",
        _path,
    ),
    Variable(
        "DFLASH_BATCH_REDIS_URL",
        "runner",
        "the queue",
        "none: a SQLite queue in the home",
        "a Redis queue, for workers on several machines sharing one home (`--redis`)",
    ),
    Variable(
        "DFLASH_BATCH_LEASE_S",
        "runner",
        "workers",
        "30",
        "seconds a worker's lease on a chunk lasts without renewal, 1 to 86400",
        _seconds,
        literal=True,
    ),
    Variable(
        "DFLASH_BATCH_ENGINE",
        "runner",
        "workers, `run`",
        "dflash_batch.engine:load_engine",
        "`module:callable`: another engine factory, called with the model keywords (the "
        "tests' fake engine)",
    ),
    Variable(
        "DFLASH_BATCH_API_KEY",
        "runner",
        "`serve`",
        "none",
        "the key clients must send (`--api-key`); needed to serve beyond loopback",
    ),
    _route(
        "DFLASH_BATCH_ATTENTION",
        "attention",
        ("stock", "kernel", "reference"),
        "kernel",
        "stock",
        "multi-row attention: stock SDPA, the block-attention kernels, or their MLX reference",
    ),
    _route(
        "DFLASH_BATCH_MATMUL",
        "matmul",
        ("stock", "kernel"),
        "kernel",
        "stock",
        "few-row products of linear layers: MLX's matmul, or the few-row kernel where the warm-up"
        " times it faster",
    ),
    _route(
        "DFLASH_BATCH_PASSES",
        "passes",
        ("eager", "compiled"),
        "compiled",
        "eager",
        "decoding passes run eagerly or replayed from a compiled trace",
    ),
    _route(
        "DFLASH_BATCH_DRAFTS",
        "drafts",
        ("chain", "tree"),
        "chain",
        "tree",
        "what a drafting cycle verifies: a chain of drafts or a draft tree",
    ),
    _route(
        "DFLASH_BATCH_CPU_OPS",
        "cpu_ops",
        ("native", "mlx"),
        "mlx",
        "native",
        "softmax, SiLU and exp on a Linux CPU: the built native ops or MLX's own",
        "Linux CPU",
    ),
    Variable(
        "DFLASH_BATCH_KERNEL_CHECK",
        "engine",
        "all backends",
        "1",
        "0 skips the kernels' self-check (the GPU kernels, the native CPU ops); a GPU kernel's pass is kept in the model cache",
        _one_of("0", "1"),
        literal=True,
    ),
    Variable(
        "DFLASH_BATCH_MEMORY_GB",
        "engine",
        "all backends",
        "the device's memory",
        "gigabytes the engine may use",
        _gigabytes,
    ),
    Variable(
        "DFLASH_BATCH_CACHE",
        "engine",
        "all backends",
        "$XDG_CACHE_HOME/dflash-batch (macOS: ~/Library/Caches/dflash-batch)",
        "where converted models, measured pass costs, kernels' passed self-checks and built ops live",
        _folder,
    ),
    Variable(
        "DFLASH_BATCH_BLAS",
        "engine",
        "Linux CPU",
        "a system OpenBLAS",
        "a CBLAS .so preloaded for MLX's CPU backend, or none",
    ),
    Variable(
        "MLX_PTX_CACHE_DIR",
        "engine",
        "CUDA",
        "the model cache's mlx-kernels folder",
        "MLX's own: where its CUDA backend keeps compiled kernels; the engine sets it where unset",
        _path,
    ),
    Variable(
        "XDG_DATA_HOME",
        "platform",
        "Linux",
        "~/.local/share",
        "the default job home is its dflash-batch folder",
        _path,
    ),
    Variable(
        "XDG_CACHE_HOME",
        "platform",
        "Linux",
        "~/.cache",
        "the default model cache is its dflash-batch folder",
        _path,
    ),
    Variable(
        "CUDA_VISIBLE_DEVICES",
        "platform",
        "workers on CUDA",
        "every GPU",
        "the GPU a worker reports as its device; `worker --device N` sets it",
    ),
    Variable(
        "CXX",
        "platform",
        "Linux CPU",
        "g++, c++ or clang++",
        "the C++ compiler that builds the native CPU ops",
    ),
    Variable(
        "PYTHONPATH",
        "platform",
        "grammars",
        "none",
        "passed on, after this package's folder, to the helper process that checks grammars",
    ),
    Variable(
        "DFLASH_BATCH_BACKEND",
        "install",
        "`.ci/install` on Linux",
        "cpu",
        "cuda13 installs MLX's CUDA wheel instead of the CPU one",
        _one_of("cpu", "cuda13"),
    ),
)
VARIABLES: Dict[str, Variable] = {v.name: v for v in _TABLE}


def get(name: str) -> Any:
    """The value of ``name`` checked by its row; where unset or empty, its default if that is a
    value, else None. The one read of the environment; ``name`` must be in the table (KeyError
    otherwise)."""
    variable = VARIABLES[name]
    text = os.environ.get(name) or (variable.default if variable.literal else "")
    return variable.read(name, text) if text else None


def group(key: str) -> Tuple[Variable, ...]:
    """The variables of one group (a key of GROUPS), in the table's order."""
    return tuple(v for v in _TABLE if v.group == key)


def check(variables: Optional[Iterable[Variable]] = None) -> None:
    """Raise ``SettingError`` for the first variable (of all, or of those given) whose value
    cannot be used."""
    for variable in _TABLE if variables is None else variables:
        get(variable.name)


def export(**values: str) -> None:
    """Set variables of the table for this process from here on and what it starts."""
    for name, value in values.items():
        if name not in VARIABLES:
            raise KeyError(f"{name} is not in the table of variables")
        os.environ[name] = value


def child(**changes: str) -> Dict[str, str]:
    """The environment for a child process: this one's, with ``changes``."""
    return dict(os.environ, **changes)


REFERENCE = "docs/configuration.md"  # written by ``markdown``; a test checks it is current


def markdown() -> str:
    """The configuration reference (``REFERENCE``): every variable, by group, with its default,
    where it applies and its doc."""
    lines = [
        "# Configuration",
        "",
        "Every environment variable the package reads. Each supplies a default only: the same setting",
        "given in code (`load_engine(...)`, `EngineConfig`) or on the command line takes precedence. A",
        "value that cannot be used is refused, naming the variable, before a job starts.",
        "",
        "Written from the one table in `dflash_batch/environment.py`; regenerate with",
        "`python -m dflash_batch.environment > docs/configuration.md` (a test checks it is current).",
    ]
    for key, title in GROUPS.items():
        lines += [
            "",
            f"## {title}",
            "",
            "| Variable | Default | Applies to | What it sets |",
            "|---|---|---|---|",
        ]
        lines += [f"| `{v.name}` | {v.default} | {v.applies} | {v.doc} |" for v in group(key)]
    return "\n".join(lines) + "\n"


def epilog() -> str:
    """The variables as the CLI's ``--help`` lists them."""
    lines = [
        f"environment variables (defaults only: settings given in code or as flags win; {REFERENCE}):"
    ]
    for key, title in GROUPS.items():
        lines.append(f"\n {title.replace('`', '')}:")
        for v in group(key):
            lines.append(f"  {v.name} (default: {v.default})")
            lines += textwrap.wrap(
                f"{v.doc} [{v.applies}]".replace("`", ""),
                96,
                initial_indent="      ",
                subsequent_indent="      ",
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
