"""Real model shapes (exact configs, random weights) and the builders that make them in memory.

A decoder's speed does not depend on its weights' values, so a random model of the exact
published shape costs what the real one costs per pass. Where each config comes from:

- Qwen3-4B, Qwen3-0.6B: the Hugging Face config.json values as quoted by several independent
  copies (research notes peers.md section 2.1 and mlx-linux.md section 5); not fetched from HF.
- Qwen3-8B: the published config as remembered and quoted by third parties; not fetched.
- Qwen3.5-4B and Qwen3.5-9B text models: third-party test fixtures of the HF configs (one copy
  each); UNVERIFIED against HF. The 4B's tied embedding is an assumption.
- Drafters: z-lab/Qwen3-4B-DFlash-b16 and z-lab/Qwen3-8B-DFlash-b16 from peers.md 2.1.
  z-lab/Qwen3.5-4B-DFlash: peers.md 2.1; its head count (32 / 8 of dim 128) is inferred from the
  published parameter count 634,425,856, which these numbers reproduce exactly.
  z-lab/Qwen3.5-9B-DFlash: 6 layers and hidden 4096 from one third-party fixture; heads, MLP
  width, taps, window and mask id are assumed like the 4B drafter's. The assumed config gives
  1.292 G parameters = 2.41 GiB in bf16, the size a third party quotes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


@dataclass
class Shape:
    name: str
    target: dict  # an mlx-lm config.json
    drafter: Optional[dict] = None  # a z-lab DFlash drafter config.json
    ar_draft: Optional[str] = None  # the name of a small AR shape for mlx_lm speculative decoding
    source: str = ""
    unverified: List[str] = field(default_factory=list)

    @property
    def hybrid(self) -> bool:
        return self.target["model_type"].startswith("qwen3_5")


def qwen3(
    hidden, layers, inter, heads, kv_heads, tied, vocab=151936, head_dim=128, max_pos=40960
) -> dict:
    return {
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 1e6,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": tied,
    }


def qwen3_5(hidden, inter, tied, layers=32) -> dict:
    return {
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": inter,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rms_norm_eps": 1e-6,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": tied,
            "rope_parameters": {
                "type": "default",
                "mrope_section": [11, 11, 10],
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
        },
    }


def tiny_qwen3_5(tied: bool, layers: int = 4) -> dict:
    """The tiny Qwen3.5 hybrid of the smoke runs: the layout of ``qwen3_5``, every width a
    multiple of 32 (of 64 where a quantized run needs it: hidden 128, intermediate 256)."""
    config = qwen3_5(128, 256, tied=tied, layers=layers)
    config["text_config"].update(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    return config


def tiny_hybrid_drafter() -> dict:
    """The DFlash drafter of ``tiny_qwen3_5``."""
    return dflash_drafter(128, 256, 2, [1, 2], 4, 3, 512, 1e7, window=64, heads=(4, 2, 32))


def dflash_drafter(
    hidden,
    inter,
    layers,
    taps,
    target_layers,
    mask_token_id,
    vocab,
    rope_theta,
    window=None,
    heads=(32, 8, 128),
) -> dict:
    """A drafter config.json in the newer nested z-lab layout; ``heads`` = (query, KV, head dim)."""
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads[0],
        "num_key_value_heads": heads[1],
        "head_dim": heads[2],
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "num_target_layers": target_layers,
        "max_position_embeddings": 262144 if window else 40960,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "dflash_config": {
            "block_size": 16,
            "mask_token_id": mask_token_id,
            "target_layer_ids": taps,
        },
    }
    if window:
        cfg["layer_types"] = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        cfg["sliding_window"] = window
    return cfg


QWEN35_TAPS = [1, 5, 9, 13, 17, 21, 25, 29]

SHAPES: Dict[str, Shape] = {
    s.name: s
    for s in [
        Shape(
            "qwen3-4b",
            qwen3(2560, 36, 9728, 32, 8, tied=True),
            dflash_drafter(2560, 9728, 5, [1, 9, 17, 25, 33], 36, 151669, 151936, 1e6),
            ar_draft="qwen3-0.6b",
            source="Qwen/Qwen3-4B + z-lab/Qwen3-4B-DFlash-b16",
        ),
        Shape(
            "qwen3-8b",
            qwen3(4096, 36, 12288, 32, 8, tied=False),
            dflash_drafter(4096, 12288, 5, [1, 9, 17, 25, 33], 36, 151669, 151936, 1e6),
            ar_draft="qwen3-0.6b",
            source="Qwen/Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16",
            unverified=["target config quoted by third parties, not fetched"],
        ),
        Shape(
            "qwen3.5-4b",
            qwen3_5(2560, 9216, tied=True),
            dflash_drafter(2560, 9216, 6, QWEN35_TAPS, 32, 248077, 248320, 1e7, window=4096),
            source="Qwen/Qwen3.5-4B + z-lab/Qwen3.5-4B-DFlash",
            unverified=["target config from one third-party fixture; tie_word_embeddings assumed"],
        ),
        Shape(
            "qwen3.5-9b",
            qwen3_5(4096, 12288, tied=False),
            dflash_drafter(4096, 12288, 6, QWEN35_TAPS, 32, 248077, 248320, 1e7, window=4096),
            source="Qwen/Qwen3.5-9B + z-lab/Qwen3.5-9B-DFlash",
            unverified=[
                "target config from one third-party fixture",
                "drafter heads, MLP width, taps, window and mask id assumed like the 4B drafter's",
            ],
        ),
        Shape(
            "qwen3-0.6b",
            qwen3(1024, 28, 3072, 16, 8, tied=True),
            source="Qwen/Qwen3-0.6B (AR draft)",
        ),
        # Scaled-down shapes for the CPU suites (2 shared cores cannot run 4B shapes at 1-4k context).
        Shape(
            "qwen3-small",
            qwen3(512, 12, 1536, 8, 4, tied=True, head_dim=64, vocab=32768, max_pos=8192),
            dflash_drafter(512, 1536, 2, [1, 9], 12, 32767, 32768, 1e6, heads=(8, 4, 64)),
            ar_draft="qwen3-tiny",
            source="scaled-down Qwen3 layout for CPU runs (not a published model)",
        ),
        Shape(
            "qwen3-tiny",
            qwen3(128, 4, 256, 4, 2, tied=True, head_dim=32, vocab=512, max_pos=4096),
            dflash_drafter(128, 256, 2, [1, 2], 4, 3, 512, 1e6, heads=(4, 2, 32)),
            ar_draft="qwen3-tiny-draft",
            source="tiny Qwen3 layout for smoke tests",
        ),
        Shape(
            "qwen3-tiny-draft",
            qwen3(64, 2, 128, 2, 1, tied=True, head_dim=32, vocab=512, max_pos=4096),
        ),
        Shape(
            "qwen3.5-tiny",
            tiny_qwen3_5(tied=True),
            tiny_hybrid_drafter(),
            source="tiny Qwen3.5 hybrid layout for smoke tests",
        ),
    ]
}


# -- builders --------------------------------------------------------------------------------


def build_target(config: dict, dtype: mx.Dtype, seed: int = 0) -> nn.Module:
    """An mlx-lm model of ``config`` with seeded random weights (MLX's own initialisers)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def build_drafter(config: dict, target_hidden: int, dtype: mx.Dtype, seed: int = 1):
    """A DFlash drafter of ``config`` (the engine's own model class) with seeded random weights."""
    from dflash_batch.engine.models.drafter import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs.from_config(config), target_hidden_size=target_hidden)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def build_tokenizer(vocab_size: int):
    """A byte-level tokenizer covering every id, with no EOS: every run generates max_tokens.

    Ids past the 256 byte symbols decode as ``<tN>``; benchmarks feed token ids, never text.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet[:vocab_size])}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok), BPEStreamingDetokenizer)


def weight_bytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def final_norm(model: nn.Module) -> nn.Module:
    """The RMSNorm in front of the LM head: model.model.norm (qwen3), under language_model
    (qwen3_5), or model.norm (the DFlash drafter)."""
    outer = getattr(model, "language_model", model)
    inner = getattr(outer, "model", None)
    return inner.norm if inner is not None else outer.norm


def text_config(config: dict) -> dict:
    return config.get("text_config", config)
