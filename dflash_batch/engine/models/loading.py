"""Finding and loading models: a local folder, or a Hugging Face repo id at a pinned revision."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import dflash2
from . import drafter as drafter_model

MODEL_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py")
DRAFTER_PATTERNS = ("*.json", "*.safetensors")


def resolve_model_path(
    name_or_path: str | Path,
    revision: Optional[str] = None,
    allow_patterns: Sequence[str] = MODEL_PATTERNS,
) -> Path:
    """A local folder as it is, else a snapshot of the Hugging Face repo (cached; offline-aware).

    ``revision`` pins a branch, tag or commit; set it for drafters, which are retrained in place.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") != 1:
        raise FileNotFoundError(f"model folder not found: {name_or_path}")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(name_or_path), revision=revision, allow_patterns=list(allow_patterns)
            )
        )
    except Exception as e:  # network, auth, missing repo: one clear message
        rev = f" at revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"could not get {name_or_path}{rev} from the Hugging Face hub: {e}"
        ) from e


def load_safetensors(folder: Path) -> dict:
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights = {}
    for f in files:
        weights.update(mx.load(f))
    return weights


def quantize_like(model: nn.Module, weights: dict, quant: Optional[dict]) -> None:
    """Quantize the layers that ``weights`` stores quantized (those with ``.scales``), as the
    config's ``quantization`` says; a per-layer entry (keyed by path) overrides the default."""
    if not quant:
        return
    default = {"group_size": quant["group_size"], "bits": quant["bits"]}
    nn.quantize(
        model,
        group_size=quant["group_size"],
        bits=quant["bits"],
        class_predicate=lambda p, m: quant.get(p, default) if f"{p}.scales" in weights else False,
    )


V1_ARCHITECTURE = "DFlashDraftModel"


def drafter_format(config: dict, where: str = "config.json"):
    """The module of the drafter a config.json describes, told by the config alone:
    engine/models/dflash2.py for DFlash 2, engine/models/drafter.py for DFlash v1 (its
    architecture, or none named)."""
    if dflash2.is_dflash2(config):
        return dflash2
    architectures = config.get("architectures") or []
    if not architectures or V1_ARCHITECTURE in architectures:
        return drafter_model
    raise ValueError(
        f"{where}: architectures {architectures} is not a drafter format this engine loads: "
        f"{V1_ARCHITECTURE!r} (DFlash v1) or {dflash2.ARCHITECTURE!r} (DFlash 2, whose dflash_config "
        f"names {', '.join(dflash2.REQUIRED_KEYS)})"
    )


def load_drafter(
    name_or_path: str | Path, revision: Optional[str] = None, dtype: Optional[mx.Dtype] = None
) -> drafter_model.Model:
    """Load a DFlash v1 or DFlash 2 drafter (``config.json`` + ``*.safetensors``, as published)."""
    folder = resolve_model_path(name_or_path, revision, DRAFTER_PATTERNS)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"drafter folder {folder} has no config.json")
    config = json.loads(config_file.read_text())
    kind = drafter_format(config, str(config_file))
    args = kind.ModelArgs.from_config(config)
    if (
        kind is drafter_model
    ):  # a draft vocabulary cuts v1's head; DFlash 2 selects over the whole one
        args.draft_vocab = read_draft_vocab(folder, config.get("vocab_size"))
    weights = load_safetensors(folder)
    fc = weights.get("fc.weight")
    if fc is None:
        raise KeyError(f"drafter weights in {folder} have no fc.weight: not a DFlash drafter")
    fc_in = (
        fc.shape[1]
        if "fc.scales" not in weights
        else fc.shape[1] * 32 // config["quantization"]["bits"]
    )
    model = kind.Model(args, target_hidden_size=fc_in // len(args.target_layer_ids))
    quantize_like(model, weights, config.get("quantization"))
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(folder: Path, vocab_size: Optional[int] = None) -> Optional[list]:
    """The drafter's draft vocabulary (``draft_vocab.json``: ``{"token_ids": [...]}``, target
    token ids, as ``training/export.py`` writes it), sorted; None when the folder has none."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f'{path}: expected {{"token_ids": [ids...]}} ({e})') from e
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise ValueError(f"{path}: token_ids must be a non-empty list of integers")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: token_ids repeat an id")
    if min(ids) < 0 or (vocab_size and max(ids) >= vocab_size):
        raise ValueError(
            f"{path}: token id {min(ids) if min(ids) < 0 else max(ids)} is outside the vocabulary ({vocab_size})"
        )
    return sorted(ids)


def load_target(
    name_or_path: str | Path, revision: Optional[str] = None, dtype: Optional[mx.Dtype] = None
) -> Tuple[nn.Module, object, dict]:
    """Load an mlx-lm target and its tokenizer: (model, TokenizerWrapper, config)."""
    from mlx_lm.utils import load_model, load_tokenizer

    folder = resolve_model_path(name_or_path, revision)
    model, config = load_model(folder)
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config
