"""The batch runner: inputs, job specs, result parts, checkpoints and the Huey queue.

Nothing here imports MLX: the runner drives whatever engine object (or engine factory) it is
given, so it can be tested and deployed apart from the engine.
"""

from .items import InputError, Item, count_rows, read_items
from .spec import JobSpec, SpecError, load_spec
from .store import RESULT_SCHEMA, ResultStore

__all__ = [
    "InputError",
    "Item",
    "JobSpec",
    "RESULT_SCHEMA",
    "ResultStore",
    "SpecError",
    "count_rows",
    "load_spec",
    "read_items",
]
