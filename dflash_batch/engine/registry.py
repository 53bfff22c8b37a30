"""Which drafter goes with which target, and the embedded default pair."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Tuple

from . import loading

# Target base name (lower case, org stripped) -> (drafter repo, revision). Published z-lab drafters.
# Revisions are None: z-lab retrains drafters in place; pin one with draft_revision=... in production.
DRAFTERS = {
    "qwen3-4b": ("z-lab/Qwen3-4B-DFlash-b16", None),
    "qwen3-8b": ("z-lab/Qwen3-8B-DFlash-b16", None),
    "qwen3.5-4b": ("z-lab/Qwen3.5-4B-DFlash", None),
    "qwen3.5-9b": ("z-lab/Qwen3.5-9B-DFlash", None),
    "qwen3.5-27b": ("z-lab/Qwen3.5-27B-DFlash", None),
    "qwen3.5-35b-a3b": ("z-lab/Qwen3.5-35B-A3B-DFlash", None),
    # The embedded default's drafter, trained by this project (dflash_batch/assets/drafters).
    "smollm2-135m-instruct": ("embedded", None),
}


def _base_name(target: str) -> str:
    name = Path(str(target).rstrip("/")).name.lower()
    name = re.sub(r"(\.q\d\w*)?\.gguf$", "", name)  # SmolLM2-135M-Instruct.Q4_1.gguf
    return re.sub(r"^(mlx-community|qwen|z-lab)[-_]", "", name)


def registered_drafter(target: str) -> Optional[Tuple[str, Optional[str]]]:
    """The drafter registered for a target name or folder, by longest matching name prefix.

    A local folder may also carry its own pairing in ``dflash_drafter.json``.
    """
    local = Path(str(target)).expanduser() / "dflash_drafter.json"
    if local.exists():
        import json

        spec = json.loads(local.read_text())
        path = Path(spec["draft"])
        if not path.is_absolute():
            path = local.parent / path
        return str(path), spec.get("revision")
    base = _base_name(target)
    best = None
    for key, value in DRAFTERS.items():
        if base.startswith(key) and (len(base) == len(key) or not base[len(key)].isdigit() and base[len(key)] != "."):
            if best is None or len(key) > len(best[0]):
                best = (key, value)
    if best and best[1][0] == "embedded":
        from . import default_model

        drafter = default_model.ensure_drafter()
        return (str(drafter), None) if drafter else None
    return best[1] if best else None


def default_pair() -> Tuple[str, Optional[str]]:
    """(target, drafter) of the embedded default, ready on disk."""
    from . import default_model

    return default_model.ensure_default_pair()


def load_any_target(target, revision, dtype):
    """An MLX model folder, a repo id, or a GGUF file."""
    if str(target).endswith(".gguf"):
        from . import gguf

        return gguf.load_gguf_target(target, dtype)
    return loading.load_target(target, revision, dtype)
