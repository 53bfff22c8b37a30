"""Llama-architecture GGUF files as mlx-lm ``llama`` models, and their conversion to MLX folders.

``mx.load`` reads a GGUF file: Q4_1 / Q8_0 tensors come back as MLX affine-quantized
``weight`` (uint32) + ``scales`` + ``biases`` with group size 32, other tensors as they are.
This module renames llama.cpp tensors to mlx-lm names, builds the config, and rebuilds the
tokenizer (GPT-2 style BPE) and chat template from the file's metadata.

llama.cpp stores q/k projection rows permuted for its interleaved RoPE; mlx-lm's
``rope_traditional=True`` is that same interleaved RoPE, so the rows are used as they are.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...files import write_folder_atomic
from .loading import quantize_like

GROUP_SIZE = 32  # every GGUF block type mx.load converts uses blocks of 32
_RENAMES = (
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
)
DTYPE_NAMES = {
    None: "as-stored",
    mx.float32: "float32",
    mx.bfloat16: "bfloat16",
    mx.float16: "float16",
}


def scalar(value):
    """A GGUF metadata value as a Python scalar (numbers come back as 0-d arrays)."""
    return value.item() if isinstance(value, mx.array) else value


def read_gguf(path: str | Path) -> Tuple[Dict[str, mx.array], dict]:
    """(tensors under mlx-lm names, metadata) of a llama GGUF file."""
    tensors, meta = mx.load(str(path), return_metadata=True)
    arch = scalar(meta.get("general.architecture"))
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    weights = {}
    for name, value in tensors.items():
        new = name
        for pattern, repl in _RENAMES:
            new, hits = re.subn(pattern, repl, name)
            if hits:
                break
        else:
            raise KeyError(f"{path}: unexpected GGUF tensor {name!r}")
        weights[new] = value
    return weights, meta


def llama_config(meta: dict, weights: Dict[str, mx.array]) -> dict:
    """The mlx-lm ``llama`` config.json for a GGUF file's ``llama.*`` metadata."""

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise KeyError(f"GGUF metadata has no llama.{key}")
        return scalar(value)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = int(scalar(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": vocab,
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": True,  # llama.cpp's interleaved RoPE layout of q/k rows
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": int(scalar(meta.get("tokenizer.ggml.bos_token_id", 1))),
        "eos_token_id": int(scalar(meta.get("tokenizer.ggml.eos_token_id", 2))),
    }
    quantized = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    if quantized:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": _bits(weights, quantized[-1])}
        # Layers whose bits differ from the common value (e.g. a Q8_0 embedding) are listed
        # per layer, as mlx-lm's loader reads them.
        for name in quantized:
            bits = _bits(weights, name)
            if bits != config["quantization"]["bits"]:
                config["quantization"][name] = {"group_size": GROUP_SIZE, "bits": bits}
    return config


def _bits(weights: Dict[str, mx.array], name: str) -> int:
    """Bits per weight from the packed shape: uint32 columns * 32 = inputs * bits."""
    packed = weights[f"{name}.weight"].shape[-1]
    inputs = weights[f"{name}.scales"].shape[-1] * GROUP_SIZE
    return packed * 32 // inputs


def build_model(config: dict, weights: Dict[str, mx.array], dtype: Optional[mx.Dtype]) -> nn.Module:
    """An mlx-lm llama model with the GGUF weights: quantized as stored (dtype None), or
    dequantized to ``dtype``."""
    from mlx_lm.utils import _get_classes, dequantize_model

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quantize_like(model, weights, config.get("quantization"))
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        dequantize_model(model)
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


# -- tokenizer -------------------------------------------------------------------------------
CONTROL = 3  # GGUF token_type of control (special) tokens


def tokenizer_files(meta: dict) -> Dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` rebuilt from GGUF metadata (gpt2 BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = scalar(meta.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = scalar(meta.get("tokenizer.ggml.pre", "default"))
    if pre == "smollm":  # StarCoder-family: digits split one by one before byte-level BPE
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == CONTROL
        ]
    )

    def token(key):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else tokens[int(scalar(value))]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(scalar(meta.get("tokenizer.ggml.add_bos_token", False))),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(scalar(meta.get("llama.context_length", 2048))),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = scalar(template)
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}


def load_gguf_tokenizer(meta: dict, eos_token_id: int):
    """mlx-lm's TokenizerWrapper for a GGUF file's tokenizer metadata."""
    from mlx_lm.utils import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="dflash-gguf-tok-") as tmp:
        for name, text in tokenizer_files(meta).items():
            Path(tmp, name).write_text(text)
        return load_tokenizer(Path(tmp), eos_token_ids=[eos_token_id])


# -- public entry points ---------------------------------------------------------------------
def load_gguf_target(
    path: str | Path, dtype: Optional[mx.Dtype] = None
) -> Tuple[nn.Module, object, dict]:
    """(model, TokenizerWrapper, config) straight from a GGUF file.

    ``dtype`` None keeps the file's quantization; a float dtype dequantizes (fp32 on CPU,
    where quantized and bf16 matmuls are slow).
    """
    weights, meta = read_gguf(path)
    config = llama_config(meta, weights)
    model = build_model(config, weights, dtype)
    tokenizer = load_gguf_tokenizer(meta, config["eos_token_id"])
    if dtype is not None:
        config.pop("quantization", None)
    return model, tokenizer, config


def convert_gguf(path: str | Path, out: str | Path, dtype: Optional[mx.Dtype] = None) -> Path:
    """Write an mlx-lm model folder for a GGUF file (atomically: a temp folder, then a rename).

    ``dtype`` None keeps the quantized weights; a float dtype stores dequantized weights.
    """
    from mlx_lm.utils import save_config, save_model

    out = Path(out)
    model, tokenizer, config = load_gguf_target(path, dtype)
    _, meta = mx.load(str(path), return_metadata=True)
    config = dict(
        config, source_gguf=Path(path).name, torch_dtype=DTYPE_NAMES.get(dtype, str(dtype))
    )

    def write(tmp: Path) -> None:
        save_model(tmp, model, donate_model=False)
        save_config(config, tmp / "config.json")
        for name, text in tokenizer_files(meta).items():
            (tmp / name).write_text(text)

    return write_folder_atomic(out, write)  # a concurrent conversion that finished first is kept
