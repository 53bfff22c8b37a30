"""Measured pass costs kept on disk, so that a machine times a model's passes once: a new process
(a worker's, a benchmark's, the next CLI run) reads the table an earlier one measured instead of
timing passes again (engine/warmup.py).

A table is kept per key, and a key names everything the costs depend on:

    machine     architecture, CPU count, the device MLX runs on (its name and memory)
    mlx         MLX's version (its kernels change from release to release)
    model       a hash of the target's and the drafter's parameter names, shapes and dtypes
                (quantized weights included), the verify block and the draft vocabulary
    routes      the routing in force (attention, matmul and pass modes, the CPU ops)
    batch       the job's batch size, and the power-of-two bucket of its typical context

The file is ``<model cache>/costs/<hash of the key>.json`` and holds the key itself: a file whose
key does not match what was asked (a collision, a hand edit, an older format) is ignored with a
warning, as is one that cannot be read; the passes are then timed again and the file replaced.
What a cycle costs beyond its passes is learnt afresh by every process (engine/widths.py).

Timed again. A process times a table's passes again where its cycles show the table too dear
(engine/widths.py, "Stale tables"), or when asked to (``Engine.warm_up``'s ``measure``). Timings
only err high, so of two timings of a pass the faster is nearer the truth: the table then keeps,
per width timed, the faster of the stored and the new timing, and each fitted line from the table
that prices it lower (``kept``). A re-timing under load so leaves a quiet table as it was, and a
quiet one replaces a stale one. Timings under another attention route or few-row matmul are of
other passes: there the cheaper table is kept whole."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import paths
from ..files import keyed_path, write_atomic
from .ops import attention, compiled, device, matmul
from .ops.kernels import cpu
from .widths import CostModel

FORMAT = 2  # bump when the stored fields change: older files no longer match any key
# a CostModel's measured part, with ``timed``
FIELDS = ("t0", "t1", "d0", "d1", "t2", "context", "route", "matmul", "rows")

log = logging.getLogger("dflash_batch.engine")


def folder() -> Path:
    """Where the tables live: a folder of the model cache (``paths.costs_dir``)."""
    return paths.costs_dir()


def machine() -> Dict[str, Any]:
    """The hardware, not the host name: a container's name changes with every start, and two
    hosts of the same hardware pay the same for a pass."""
    info = {"arch": platform.machine(), "cpus": os.cpu_count(), "backend": device.backend()}
    info.update(device.hardware())
    return info


def model_hash(engine) -> str:
    """The target's and the drafter's parameters (name, shape, dtype), hashed."""
    digest = hashlib.sha256()
    for model in (engine.target.model, engine.drafter):
        if model is None:
            digest.update(b"none")
            continue
        for name, value in tree_flatten(model.parameters()):
            digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
    return digest.hexdigest()[:32]


def key(engine, batch_size: int, context_bucket: int) -> Dict[str, Any]:
    """Everything a table's costs depend on (module doc)."""
    return {
        "format": FORMAT,
        "machine": machine(),
        "mlx": mx.__version__,
        "model": model_hash(engine),
        "block": engine.block_size,
        "draft_vocab": None if engine.draft_head is None else len(engine.draft_head),
        "routes": {
            "attention": attention.mode(),
            "matmul": matmul.mode(),
            "passes": compiled.mode(),
            "cpu_ops": cpu.in_force(),
        },
        "batch_size": batch_size,
        "context": context_bucket,
    }


def path_of(table_key: Dict[str, Any]) -> Path:
    return keyed_path(folder(), table_key)


def save(table_key: Dict[str, Any], cost: CostModel) -> Optional[Path]:
    """Keep ``cost``'s measured passes under ``table_key``; a cache that cannot be written only
    warns (the job goes on with the costs it measured)."""
    measured = {name: getattr(cost, name) for name in FIELDS}
    measured["timed"] = {str(T): s for T, s in cost.timed.items()}
    path = path_of(table_key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            path, json.dumps({"key": table_key, "cost": measured}, sort_keys=True, indent=1)
        )
    except OSError as e:
        warnings.warn(f"pass costs not kept in {path}: {e}", stacklevel=2)
        return None
    return path


def load(table_key: Dict[str, Any]) -> Optional[CostModel]:
    """The costs kept under ``table_key``, or None (none kept; unreadable or stale: warned)."""
    path = path_of(table_key)
    if not path.exists():
        return None
    try:
        cost = _read(path, table_key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(
            f"ignoring the pass costs kept in {path} ({e}); timing the passes again", stacklevel=2
        )
        return None
    log.info("pass costs for batch size %d read from %s", table_key["batch_size"], path)
    return cost


def keep(table_key: Dict[str, Any], measured: CostModel) -> CostModel:
    """Keep passes just timed under ``table_key``, with what a table already kept there timed
    faster (module doc, "Timed again"); returns the costs kept."""
    try:
        stored = _read(path_of(table_key), table_key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        # none kept, or one that load warned of: replaced
        stored = None
    cost = measured if stored is None else kept(stored, measured)
    save(table_key, cost)
    return cost


def kept(stored: CostModel, measured: CostModel) -> CostModel:
    """The faster of two timings of each pass (module doc): per width timed at the table's rows,
    and per fitted line, the target's where it is read (at one row, over the widths timed) and
    the drafter's at the table's rows."""
    if (stored.route, stored.matmul, stored.rows) != (
        measured.route,
        measured.matmul,
        measured.rows,
    ):
        return min(measured, stored, key=lambda c: c.passes(c.rows, max(c.timed, default=1)))
    cost = replace(measured, timed=dict(measured.timed))
    for T, seconds in stored.timed.items():
        cost.timed[T] = min(seconds, cost.timed.get(T, seconds))
    widths = sorted(cost.timed) or [1]
    if sum(map(stored.line, widths)) < sum(map(measured.line, widths)):
        cost.t0, cost.t1, cost.t2 = stored.t0, stored.t1, stored.t2
    if stored.d0 + stored.d1 * stored.rows < measured.d0 + measured.d1 * measured.rows:
        cost.d0, cost.d1 = stored.d0, stored.d1
    return cost


def _read(path: Path, table_key: Dict[str, Any]) -> CostModel:
    stored = json.loads(path.read_text())
    if stored.get("key") != table_key:
        raise ValueError("its key is not this model's, machine's or batch's")
    measured = stored["cost"]
    cost = CostModel(**{name: measured[name] for name in FIELDS})
    cost.timed = {int(T): float(s) for T, s in measured["timed"].items()}
    if not all(isinstance(getattr(cost, n), (int, float)) for n in ("t0", "t1", "d0", "d1", "t2")):
        raise ValueError("a cost is not a number")
    return cost


__all__ = ["folder", "keep", "kept", "key", "load", "save"]
