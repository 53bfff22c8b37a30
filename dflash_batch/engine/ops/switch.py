"""A routing choice for the whole process, one per module that routes (attention, few-row
products, compiled passes): set in code (``set``), else the module's environment variable, else a
default by backend (CUDA or anything else). ``engine/routing.py`` sets them for a block of code.
``repoint`` is how a module reaches the functions mlx-lm model files import by name."""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional, Sequence

from ...errors import SettingError
from . import device


class Switch:
    made: List["Switch"] = []  # every switch, so their variables can be checked before any work

    def __init__(self, name: str, env: str, modes: Sequence[str], cuda: str, elsewhere: str):
        self.name, self.env, self.modes = name, env, tuple(modes)
        self.cuda, self.elsewhere = cuda, elsewhere
        self.chosen: Optional[str] = None  # as set; None: the default
        Switch.made.append(self)

    def default(self) -> str:
        """The environment variable if set, else the backend's default."""
        env = os.environ.get(self.env)
        if env and env not in self.modes:
            raise SettingError(f"{self.env}={env!r}: expected one of {self.modes}")
        return env or (self.cuda if device.backend() == "cuda" else self.elsewhere)

    def set(self, mode: Optional[str]) -> None:
        """Choose the mode for the whole process; None returns to the default."""
        if mode is not None and mode not in self.modes:
            raise ValueError(f"{self.name} mode must be one of {self.modes} or None, got {mode!r}")
        self.chosen = mode

    def mode(self) -> str:
        return self.chosen or self.default()


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


__all__ = ["Switch", "repoint"]
