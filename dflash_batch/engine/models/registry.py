"""Which drafter goes with which target, and the embedded default pair."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from . import loading

log = logging.getLogger(__name__)

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
# Other target families (docs/models.md, "Target families"): z-lab's drafters for Gemma-4, gpt-oss,
# Qwen3-Coder and LLaMA-3.1 (named z-lab/<Target>-DFlash but for LLaMA's), poolside's for Laguna.
DRAFTERS.update({
    "gemma-4-26b-a4b-it": ("z-lab/gemma-4-26B-A4B-it-DFlash", None),
    "gemma-4-31b-it": ("z-lab/gemma-4-31B-it-DFlash", None),
    "gpt-oss-20b": ("z-lab/gpt-oss-20b-DFlash", None),
    "gpt-oss-120b": ("z-lab/gpt-oss-120b-DFlash", None),
    "qwen3-coder-30b-a3b": ("z-lab/Qwen3-Coder-30B-A3B-DFlash", None),
    "llama-3.1-8b-instruct": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", None),
    "meta-llama-3.1-8b": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", None),  # mlx-community's Meta-Llama-3.1-8B-Instruct
    "laguna-xs-2.1": ("poolside/Laguna-XS-2.1-DFlash", None),
})


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


_warned: Set[str] = set()  # targets already warned about: a worker loads its engine more than once


def auto_drafter(target: str) -> Optional[Tuple[str, Optional[str]]]:
    """The drafter ``draft="auto"`` takes for ``target``. With none registered the target decodes
    plainly, several times slower: a warning says so (once per target), and how to give one."""
    found = registered_drafter(target)
    if found is None and target not in _warned:
        _warned.add(target)
        log.warning(
            "no DFlash drafter is registered for target %s: it decodes without speculation "
            "(plain autoregressive). Give one with --draft FOLDER|REPO (YAML model.draft, "
            "Python draft=...); `dflash-batch drafters` lists the registered pairs; --no-draft "
            "(draft=None) chooses plain decoding without this warning.", target)  # fmt: skip
    return found


def pairs() -> List[Dict[str, Any]]:
    """The registered target/drafter pairs, with the drafter's block size where it is known
    without downloading it (a ``-bN`` repo name, the embedded drafter's config); no model is
    loaded or fetched."""
    from . import default_model

    out = []
    for target, (drafter, revision) in DRAFTERS.items():
        block = re.search(r"-b(\d+)$", drafter)
        entry = {"target": target, "drafter": drafter, "revision": revision, "default": False,
                 "block_size": int(block.group(1)) if block else None}  # fmt: skip
        if drafter == "embedded":
            config = json.loads((default_model.DRAFTER_ASSET / "config.json").read_text())
            entry.update(drafter=str(default_model.DRAFTER_ASSET), default=True,
                         block_size=config.get("dflash_config", {}).get("block_size"))  # fmt: skip
        out.append(entry)
    return out


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
