"""Writing a trained drafter in the z-lab on-disk format that ``loading.load_drafter`` reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..engine.models.loading import DRAFT_VOCAB_FILE
from ..files import write_atomic


def drafter_config(
    target_config: dict,
    layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: List[int],
    intermediate_size: Optional[int] = None,
) -> dict:
    """A Qwen3-style DFlash drafter config (nested ``dflash_config``) with the target's width."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate_size or target_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-6),
        "vocab_size": target_config["vocab_size"],
        "num_target_layers": target_config["num_hidden_layers"],
        "max_position_embeddings": target_config.get("max_position_embeddings", 4096),
        "rope_theta": float(target_config.get("rope_theta", 1e6)),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
        },
    }


def save_drafter(
    folder: str | Path,
    drafter: nn.Module,
    config: dict,
    dtype: str = "bfloat16",
    quantize_bits: Optional[int] = None,
    group_size: int = 64,
) -> Path:
    """config.json + model.safetensors; linear layers optionally ``quantize_bits``-bit affine."""
    from ..engine.models.drafter import Model, ModelArgs

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = Model(ModelArgs.from_config(config), target_hidden_size=drafter.target_hidden_size)
    model.load_weights(tree_flatten(drafter.parameters()), strict=True)
    model.set_dtype(getattr(mx, dtype))
    config = dict(config, torch_dtype=dtype)
    if quantize_bits:
        nn.quantize(
            model,
            group_size=group_size,
            bits=quantize_bits,
            class_predicate=lambda p, m: isinstance(m, nn.Linear),
        )
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    else:
        config.pop("quantization", None)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def draft_vocab(
    answers: Iterable[Sequence[int]], vocab_size: int, size: int, always: Sequence[int] = ()
) -> dict:
    """The ``size`` tokens the target writes most in ``answers`` (ties: the lower id), with
    ``always`` (its EOS ids) among them: ``{"token_ids": sorted ids, "answers", "answer_tokens",
    "coverage"}``, coverage being the share of the answers' tokens the ids hold."""
    answers = [np.asarray(a, dtype=np.int64) for a in answers]
    n = len(answers)
    counts = np.bincount(
        np.concatenate(answers) if answers else np.zeros(0, np.int64), minlength=vocab_size
    )[:vocab_size]
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    taken = set(forced)
    rest = [int(i) for i in np.argsort(-counts, kind="stable") if int(i) not in taken]
    ids = sorted(forced + rest[: max(size - len(forced), 0)])
    total = int(counts.sum())
    return {
        "token_ids": ids,
        "answers": n,
        "answer_tokens": total,
        "coverage": round(float(counts[ids].sum()) / max(total, 1), 5),
    }


def save_draft_vocab(folder: str | Path, vocab: dict) -> Path:
    """``folder/draft_vocab.json``: ``loading.read_draft_vocab`` reads it with the drafter."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    write_atomic(path, json.dumps(vocab).encode() + b"\n")
    return path
