"""The routing modes: how each pass computes (attention, few-row products, compiled passes, draft
shape, CPU ops) and how ragged batches attend. Each mode is declared once here (``SWITCHES``: its
field and environment variable, whose row in dflash_batch/environment.py holds its choices and
default by backend); ``Routes`` holds one choice of each.

An engine holds its own ``Routes`` (``EngineConfig``) and puts them in force for each of its
steps (``use``, ``stepping``), so two engines in one process each run their own. The routed ops
ask ``current()``: the routes of the engine stepping now, else the defaults (the environment,
then the backend), or those a block of code chose (``use``: a test, a benchmark's baseline).
A context variable holds them, so a thread or task sees only what it put in force.
``repoint`` is the one process-wide act: how the routed ops reach the functions mlx-lm model
files import by name."""

from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, TypeVar

from ... import environment
from . import device

RAGGED_ROUTES = ("block", "sdpa")


@dataclass(frozen=True)
class Switch:
    """One routing mode's declaration: its ``Routes`` field and its environment variable, whose
    row in the package's table (dflash_batch/environment.py) gives the choices and the default
    on each backend."""

    field: str
    name: str
    env: str

    @property
    def modes(self) -> Sequence[str]:
        return environment.VARIABLES[self.env].choices

    @property
    def cuda(self) -> str:  # the default on CUDA
        return environment.VARIABLES[self.env].by_backend[0]

    @property
    def elsewhere(self) -> str:  # the default on the CPU and Metal
        return environment.VARIABLES[self.env].by_backend[1]

    def default(self) -> str:
        """The environment variable if set, else the backend's default."""
        return environment.get(self.env) or (
            self.cuda if device.backend() == "cuda" else self.elsewhere
        )

    def resolve(self, mode: Optional[str]) -> str:
        """``mode`` checked, or the default for None."""
        if mode is None:
            return self.default()
        if mode not in self.modes:
            raise ValueError(
                f"{self.field} must be one of {tuple(self.modes)} or None, got {mode!r}"
            )
        return mode


# fmt: off
SWITCHES = (
    Switch("attention", "attention", "DFLASH_BATCH_ATTENTION"),
    Switch("matmul", "matmul", "DFLASH_BATCH_MATMUL"),
    Switch("passes", "pass", "DFLASH_BATCH_PASSES"),
    Switch("drafts", "draft", "DFLASH_BATCH_DRAFTS"),
    Switch("cpu_ops", "cpu ops", "DFLASH_BATCH_CPU_OPS"),
)
# fmt: on
BY_FIELD = {switch.field: switch for switch in SWITCHES}


@dataclass(frozen=True)
class Routes:
    """One choice of every routing mode (None: the default) and the ragged route: "block" sends
    ragged batches to the block attention with per-row key lengths, "sdpa" to stock SDPA with a
    per-row mask (engine/ops/attention.py)."""

    attention: Optional[str] = None
    matmul: Optional[str] = None
    passes: Optional[str] = None
    drafts: Optional[str] = None
    cpu_ops: Optional[str] = None
    ragged: str = "block"

    def __post_init__(self):
        for switch in SWITCHES:
            object.__setattr__(self, switch.field, switch.resolve(getattr(self, switch.field)))
        if self.ragged not in RAGGED_ROUTES:
            raise ValueError(f"ragged route must be one of {RAGGED_ROUTES}, got {self.ragged!r}")

    def replace(self, **chosen) -> "Routes":
        return dataclasses.replace(self, **chosen)


_in_force: ContextVar[Optional[Routes]] = ContextVar("dflash_batch_routes", default=None)
_defaults: List[Routes] = []  # the routes where none are in force, resolved at first use


def current() -> Routes:
    """The routes in force: the stepping engine's, a block's (``use``), else the defaults (the
    variables and the backend as they were at first use: asked on every routed call, so read
    once; an engine reads them when it is made)."""
    routes = _in_force.get()
    if routes is not None:
        return routes
    if not _defaults:
        _defaults.append(Routes())
    return _defaults[0]


@contextmanager
def use(routes: Routes) -> Iterator[Routes]:
    """Put ``routes`` in force for the block; what was in force before returns after it."""
    token = _in_force.set(routes)
    try:
        yield routes
    finally:
        _in_force.reset(token)


def modes(**chosen: Optional[str]):
    """The routes in force with the modes named changed, for the block (``attention=...``,
    ``matmul=...``, ``passes=...``, ``drafts=...``, ``cpu_ops=...``, ``ragged=...``)."""
    return use(current().replace(**chosen))


def stock_ops():
    """MLX's own attention, matmul and CPU ops for the block: for mlx-lm's generate functions on
    a model the engine routes (the benchmarks' baselines)."""
    return modes(attention="stock", matmul="stock", cpu_ops="mlx")


T = TypeVar("T")


def stepping(routes: Routes, steps: Iterator[T]) -> Iterator[T]:
    """``steps`` advanced with ``routes`` in force, and only while it advances: the consumer, and
    another engine's steps between two of these, run under their own."""
    steps = iter(steps)
    try:
        while True:
            with use(routes):
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item
    finally:  # a consumer that stops early closes the steps now, as it would have closed them
        close = getattr(steps, "close", None)
        if close is not None:
            with use(routes):
                close()


def repoint(model, name: str, stock: Callable, routed: Callable) -> List[str]:
    """Point ``name`` (a function mlx-lm model files import by name, such as
    ``scaled_dot_product_attention``) at ``routed`` in the module file of each of ``model``'s
    modules where it is ``stock``; returns the module files changed (none when already done)."""
    patched = []
    for _, module in model.named_modules():
        owner = sys.modules.get(type(module).__module__)
        if owner is not None and getattr(owner, name, None) is stock:
            setattr(owner, name, routed)
            patched.append(owner.__name__)
    return patched


__all__ = [
    "BY_FIELD",
    "RAGGED_ROUTES",
    "Routes",
    "SWITCHES",
    "Switch",
    "current",
    "modes",
    "repoint",
    "stepping",
    "stock_ops",
    "use",
]
