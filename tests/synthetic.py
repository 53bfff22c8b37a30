"""Seeded random models saved in the real on-disk formats, for tests.

A model's speed does not depend on its weights' values, and exactness tests need only a real
architecture, a real tokenizer and real files; none of this needs a model hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import dflash_batch.engine  # noqa: F401  (loads the BLAS before mlx.core, as the engine does)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a block of tokens and "
    "the target model verifies them in one pass. Summaries, code, arithmetic: 1 + 2 = 3, 12 * 7 = 84. "
    "def add(a, b):\n    return a + b\nHello! How are you today? I am fine, thank you. "
)


def _syllable_text(lines: int = 400) -> List[str]:
    """Deterministic pseudo-words, enough for a BPE to fill a vocabulary of a few thousand."""
    cons, vows = "bcdfghjklmnprstvwz", "aeiou"
    out = []
    for i in range(lines):
        words = []
        for j in range(12):
            n = (i * 31 + j * 17) % 997
            syl = [
                cons[(n + 7 * k) % len(cons)] + vows[(n // 3 + k) % len(vows)]
                for k in range(1 + n % 3)
            ]
            words.append("".join(syl))
        out.append(" ".join(words) + (". " if i % 2 else ", ") + str(i * 13))
    return out


def save_tokenizer(folder: Path, vocab_size: int = 512) -> Dict[str, int]:
    """Train a tiny byte-level BPE (deterministic, offline) and save HF tokenizer files.

    Returns the ids of the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 50 + _syllable_text(), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer came out with {tok.get_vocab_size()} ids, wanted {vocab_size}")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids


def _randomize(model: nn.Module, seed: int, scale: float) -> None:
    """Seeded normal weights for every matrix; norms stay at one."""
    mx.random.seed(seed)
    params = tree_flatten(model.parameters())
    new = []
    for name, p in params:
        if p.ndim >= 2:
            fan_in = p.shape[-1]
            new.append((name, (mx.random.normal(p.shape) * (scale / fan_in**0.5)).astype(p.dtype)))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())


def save_target(
    folder: Path,
    config: dict,
    seed: int = 0,
    scale: float = 1.0,
    zero_head: bool = False,
    dtype: mx.Dtype = mx.float32,
    with_tokenizer: bool = True,
    adjust=None,
) -> Path:
    """Build an mlx-lm model from ``config`` with seeded random weights and save it.

    ``zero_head`` zeroes the (tied) embedding's output projection so every logit is equal and
    the greedy next token is always id 0: a target whose choice is known in advance. ``adjust``
    (model -> None) changes the model before it is saved (weights that are not matrices).
    """
    from mlx_lm.utils import _get_classes, save_config, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    _randomize(model, seed, scale)
    if adjust is not None:
        adjust(model)
    if zero_head:
        head = getattr(model, "lm_head", None) or getattr(
            getattr(model, "language_model", None), "lm_head", None
        )
        if head is not None:
            head.weight = mx.zeros_like(head.weight)
        else:
            model.apply_to_modules(
                lambda k, m: (
                    setattr(m, "weight", mx.zeros_like(m.weight))
                    if k.endswith("embed_tokens")
                    else None
                )
            )
    if with_tokenizer:
        ids = save_tokenizer(folder, vocab_size=min(config.get("vocab_size", 512), 512))
        config = dict(config, eos_token_id=ids["<|im_end|>"])
    save_model(folder, model)
    save_config(config, folder / "config.json")
    return folder


def save_quantized(
    source: Path,
    folder: Path,
    mode: str = "affine",
    group_size: Optional[int] = None,
    bits: Optional[int] = None,
    quant_predicate=None,
    global_scale: bool = False,
) -> Path:
    """Quantize a saved model with mlx-lm's own converter (``mlx_lm.convert``: its quantizer, its
    per-model predicates such as qwen3_5_moe's 8-bit router, and its on-disk format, a config with
    a ``quantization`` entry). ``quant_predicate``: a recipe name ("mixed_4_6") or a callable
    (path, module) -> bool | dict, as the converter takes them. ``global_scale`` (nvfp4: one
    tensor scale per expert on MoE switch layers), which the converter does not offer: its
    quantizer and saver called as it calls them."""
    import contextlib
    import io

    from mlx_lm.convert import convert
    from mlx_lm.utils import load, quantize_model, save

    folder = Path(folder)
    with contextlib.redirect_stdout(io.StringIO()):  # their [INFO] lines
        if not global_scale:
            convert(
                str(source),
                str(folder),
                quantize=True,
                q_group_size=group_size,
                q_bits=bits,
                q_mode=mode,
                quant_predicate=quant_predicate,
            )
            return folder
        model, tokenizer, config = load(str(source), return_config=True, lazy=True)
        model, config = quantize_model(
            model,
            config,
            group_size,
            bits,
            mode=mode,
            global_scale=True,
            quant_predicate=quant_predicate,
        )
        save(folder, source, model, tokenizer, config)
    return folder


def tiny_qwen3_config(vocab_size: int = 512, layers: int = 4, hidden: int = 128) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    }


def tiny_llama_config(vocab_size: int = 512, layers: int = 4, hidden: int = 128) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 1e4,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def drafter_config(
    target_config: dict,
    layers: int = 2,
    block_size: int = 16,
    mask_token_id: int = 3,
    target_layer_ids: Optional[List[int]] = None,
    nested: bool = False,
    sliding_window: Optional[int] = None,
) -> dict:
    """A drafter config in the z-lab format, flat (older) or nested ``dflash_config`` (newer)."""
    hidden = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    taps = target_layer_ids
    if taps is None:
        from dflash_batch.engine.models.drafter import build_target_layer_ids

        taps = build_target_layer_ids(target_config["num_hidden_layers"], layers)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": target_config["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim", hidden // heads),
        "rms_norm_eps": 1e-6,
        "vocab_size": target_config["vocab_size"],
        "num_target_layers": target_config["num_hidden_layers"],
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    if sliding_window:
        cfg["layer_types"] = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg["sliding_window"] = sliding_window
    dflash = {"block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": taps}
    if nested:
        cfg["dflash_config"] = dflash
        cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    else:
        cfg.update(dflash)
        cfg["rope_theta"] = 1e6
    return cfg


def save_drafter(
    folder: Path, config: dict, seed: int = 1, scale: float = 1.0, dtype=mx.float32
) -> Path:
    """A seeded random drafter with exactly the published weight names (no embedding, no head)."""
    from dflash_batch.engine.models.drafter import Model, ModelArgs

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = Model(ModelArgs.from_config(config))
    model.set_dtype(dtype)
    _randomize(model, seed, scale)
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tiny_qwen3_5_config(
    vocab_size: int = 512, layers: int = 4, hidden: int = 64, moe: bool = False
) -> dict:
    """A tiny mlx-lm ``qwen3_5`` (or ``qwen3_5_moe``) text config: 3 GatedDeltaNet layers, then
    1 attention layer, repeated. Linear heads are 32 wide so the fused kernels accept them."""
    cfg = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
        },
    }
    if moe:
        cfg.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=hidden,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    return cfg


LOSSLESS_PROMPTS = ["Hi", "Write a haiku about the sea.", "How are you today? " * 12]


def assert_dflash_lossless(target: Path, drafter: Path, max_tokens: int = 40) -> None:
    """Greedy DFlash output equals plain decoding of the same target, token for token, on prompts
    short and long, and every one of them really drafted (drafts verified: fewer cycles than
    tokens held for plain decoding too, whose first token is the prefill's). The drafting
    engine's pass costs are given: timed ones, on a busy CPU, may keep it plain."""
    from dflash_batch.engine import load_engine

    from tests.helpers import fixed_costs

    ar = load_engine(target, draft=None)
    spec = load_engine(target, draft=drafter, cost_model=fixed_costs())
    for prompt in LOSSLESS_PROMPTS:
        want = ar.generate(prompt, max_tokens=max_tokens).token_ids
        got = spec.generate(prompt, max_tokens=max_tokens)
        assert got.token_ids == want, prompt
        assert got.stats.drafted_tokens > 0, prompt  # it really drafted
