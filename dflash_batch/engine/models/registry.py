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
# fmt: off
DRAFTERS = {
    "qwen3-4b": ("z-lab/Qwen3-4B-DFlash-b16", None),
    "qwen3-8b": ("z-lab/Qwen3-8B-DFlash-b16", None),
    "qwen3.5-4b": ("z-lab/Qwen3.5-4B-DFlash", None),
    "qwen3.5-9b": ("z-lab/Qwen3.5-9B-DFlash", None),
    "qwen3.5-27b": ("z-lab/Qwen3.5-27B-DFlash", None),
    "qwen3.5-35b-a3b": ("z-lab/Qwen3.5-35B-A3B-DFlash", None),
    "qwen3.5-122b-a10b": ("z-lab/Qwen3.5-122B-A10B-DFlash", None),
    "qwen3.5-397b-a17b": ("z-lab/Qwen3.5-397B-A17B-DFlash", None),
    "qwen3.8-27b": ("z-lab/Qwen3.8-27B-DFlash2", None),  # DFlash 2 (engine/models/dflash2.py)
    # The embedded default's drafter, trained by this project (dflash_batch/assets/drafters).
    "smollm2-135m-instruct": ("embedded", None),
    # Other target families (docs/models.md, "Target families"): z-lab's drafters for Gemma-4,
    # gpt-oss, Qwen3-Coder and LLaMA-3.1 (named z-lab/<Target>-DFlash but for LLaMA's), poolside's
    # for Laguna.
    "gemma-4-26b-a4b-it": ("z-lab/gemma-4-26B-A4B-it-DFlash", None),
    "gemma-4-31b-it": ("z-lab/gemma-4-31B-it-DFlash", None),
    "gpt-oss-20b": ("z-lab/gpt-oss-20b-DFlash", None),
    "gpt-oss-120b": ("z-lab/gpt-oss-120b-DFlash", None),
    "qwen3-coder-30b-a3b": ("z-lab/Qwen3-Coder-30B-A3B-DFlash", None),
    "llama-3.1-8b-instruct": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", None),
    "meta-llama-3.1-8b": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", None),  # mlx-community's Meta-Llama-3.1-8B-Instruct
    "laguna-xs-2.1": ("poolside/Laguna-XS-2.1-DFlash", None),
}


V1, V2 = "DFlash v1", "DFlash 2"

# Every published pairing the project's research notes document (../shared/research: peers.md
# "Published drafters", peers-3.md sections 1.1 and 5, dflash2-format.md): target base name, drafter
# repo, generation, recommended verify block (None: not documented; the drafter's config says what
# it was trained with), and what is known of it. ``draft="auto"`` takes DRAFTERS' one per target;
# the others are listed by ``dflash-batch drafters`` and given with --draft REPO.
PUBLISHED = [
    ("qwen3-4b", "z-lab/Qwen3-4B-DFlash-b16", V1, 16, "trained without thinking"),
    ("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", V1, 16, "trained without thinking"),
    ("qwen3.5-4b", "z-lab/Qwen3.5-4B-DFlash", V1, 16, "retrained in place: pin a revision"),
    ("qwen3.5-9b", "z-lab/Qwen3.5-9B-DFlash", V1, None, ""),
    ("qwen3.5-27b", "z-lab/Qwen3.5-27B-DFlash", V1, None, ""),
    ("qwen3.5-35b-a3b", "z-lab/Qwen3.5-35B-A3B-DFlash", V1, None, ""),
    ("qwen3.5-122b-a10b", "z-lab/Qwen3.5-122B-A10B-DFlash", V1, None, "retrained in place: pin a revision"),
    ("qwen3.5-397b-a17b", "z-lab/Qwen3.5-397B-A17B-DFlash", V1, None, ""),
    ("llama-3.1-8b-instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", V1, None, ""),
    ("gemma-4-31b-it", "z-lab/gemma-4-31B-it-DFlash", V1, None, "target family: docs/models.md"),
    ("gemma-4-26b-a4b-it", "z-lab/gemma-4-26B-A4B-it-DFlash", V1, None, "target family: docs/models.md"),
    ("qwen3.8-27b", "z-lab/Qwen3.8-27B-DFlash2", V2, 5, "trained block 8; block 5 recommended on MLX 4-bit"),
    ("qwen3.8-27b", "incoai/Qwen3.8-27B-DFlash2", V2, None, "Inco AI; repo name from incoai/*-DFlash2"),
    ("qwen3-4b", "AQ-MedAI/Qwen3-4B-DFlash2", V2, 8, "third party, trained with speculators: format not checked"),
    ("ornith-1.5-9b", "resolvo-cloud/Ornith-1.5-9B-DFlash2", V2, None, "third party; target family not checked here"),
    ("ornith-1.5-35b-a3b", "jzinno/Ornith-1.5-35B-A3B-DFlash2", V2, None, "third party; target family not checked here"),
]
# fmt: on


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
    key = _longest_match(_base_name(target), DRAFTERS)
    if key and DRAFTERS[key][0] == "embedded":
        from . import default_model

        drafter = default_model.ensure_drafter()
        return (str(drafter), None) if drafter else None
    return DRAFTERS[key] if key else None


def _longest_match(base: str, names) -> Optional[str]:
    """The longest of ``names`` that ``base`` starts with, where the next character does not
    continue a number (qwen3-4b is not qwen3-4b5, nor qwen3.5-4b.1)."""
    best = None
    for key in names:
        if base.startswith(key) and (
            len(base) == len(key) or not base[len(key)].isdigit() and base[len(key)] != "."
        ):
            if best is None or len(key) > len(best):
                best = key
    return best


def published_for(target: str) -> List[str]:
    """The published drafters (PUBLISHED) for a target name that DRAFTERS does not pair it with."""
    key = _longest_match(_base_name(target), {t for t, *_ in PUBLISHED})
    return [f"{drafter} ({generation})" for t, drafter, generation, _, _ in PUBLISHED if t == key]


_warned: Set[str] = set()  # targets already warned about: a worker loads its engine more than once


def auto_drafter(target: str) -> Optional[Tuple[str, Optional[str]]]:
    """The drafter ``draft="auto"`` takes for ``target``. With none registered the target decodes
    plainly, several times slower: a warning says so (once per target), and how to give one."""
    found = registered_drafter(target)
    if found is None and target not in _warned:
        _warned.add(target)
        published = published_for(target)
        also = (
            f" Published for this target, untested here: {', '.join(published)}."
            if published
            else ""
        )
        log.warning(
            "no DFlash drafter is registered for target %s: it decodes without speculation "
            "(plain autoregressive).%s Give one with --draft FOLDER|REPO (YAML model.draft, "
            "Python draft=...); `dflash-batch drafters` lists the registered and published pairs; "
            "--no-draft (draft=None) chooses plain decoding without this warning.", target, also)  # fmt: skip
    return found


def pairs() -> List[Dict[str, Any]]:
    """The registered target/drafter pairs (``auto``: what draft="auto" takes), then the other
    published ones, with generation, the recommended block size where it is known without
    downloading the drafter (the table, a ``-bN`` repo name, the embedded drafter's config) and
    a note; no model is loaded or fetched."""
    from . import default_model

    known = {
        drafter: (generation, block, note) for _, drafter, generation, block, note in PUBLISHED
    }
    out = []
    for target, (drafter, revision) in DRAFTERS.items():
        generation, block, note = known.get(drafter, (V1, None, ""))
        named = re.search(r"-b(\d+)$", drafter)
        entry = {"target": target, "drafter": drafter, "revision": revision, "default": False, "auto": True,
                 "generation": generation, "block_size": block or (int(named.group(1)) if named else None),
                 "note": note}  # fmt: skip
        if drafter == "embedded":
            config = json.loads((default_model.DRAFTER_ASSET / "config.json").read_text())
            entry.update(drafter=str(default_model.DRAFTER_ASSET), default=True, note="trained by this project",
                         block_size=config.get("dflash_config", {}).get("block_size"))  # fmt: skip
        out.append(entry)
    taken = {drafter for drafter, _ in DRAFTERS.values()}
    for target, drafter, generation, block, note in PUBLISHED:
        if drafter not in taken:
            out.append({"target": target, "drafter": drafter, "revision": None, "default": False, "auto": False,
                        "generation": generation, "block_size": block, "note": note})  # fmt: skip
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
