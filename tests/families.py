"""Tiny mlx-lm configs of the target families beside qwen3/qwen3_5 (docs/models.md, "Target
families"), each with the parts that family brings: mixture-of-experts layers, sliding-window
layers (a window of WINDOW positions, so test prompts run far past it), attention sinks,
KV-shared layers, logit soft-capping, scaled embeddings."""

from __future__ import annotations

WINDOW = 8
HEAD_DIM = (
    64  # one the GPU kernels take (engine/ops/kernels/attention.py HEAD_DIMS), so they run on a GPU
)


def _base(model_type: str, layers: int = 4, hidden: int = 64) -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": hidden * 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096,
            "rope_theta": 1e4, "tie_word_embeddings": False}  # fmt: skip


def qwen3_moe() -> dict:
    """Qwen3-Coder-30B-A3B's architecture: every layer's MLP a top-2 of 4 experts."""
    return dict(_base("qwen3_moe"), num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip


def llama() -> dict:
    """Llama with mlx-lm's optional sliding-window layers (LLaMA-3.1 itself has none)."""
    return dict(
        _base("llama"),
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=WINDOW,
    )


def gemma4_text() -> dict:
    """Gemma-4 26B-A4B / 31B's parts: sliding and full layers (full ones with wider heads and K = V),
    the last two layers reusing earlier layers' K/V, an MoE block beside the MLP, scaled
    embeddings and soft-capped logits."""
    return dict(_base("gemma4_text", layers=6), global_head_dim=128, num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=512, sliding_window=WINDOW,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4,
                top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0,
                tie_word_embeddings=True)  # fmt: skip


def gemma4_ple() -> dict:
    """Gemma-4's small models (E2B / E4B): per-layer input embeddings beside the token's, dense MLPs."""
    return dict(
        gemma4_text(),
        hidden_size_per_layer_input=16,
        enable_moe_block=False,
        attention_k_eq_v=False,
    )


def gemma4() -> dict:
    """What the published Gemma-4 checkpoints are: ``gemma4``, the text model inside a wrapper
    (``model.language_model``) with the vision and audio towers left out."""
    text = {k: v for k, v in gemma4_text().items() if k != "model_type"}
    return {"model_type": "gemma4", "vocab_size": text["vocab_size"], "text_config": text}


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def gpt_oss() -> dict:
    """gpt-oss: sliding and full layers alternating, attention sinks, a top-2 of 4 experts."""
    return dict(_base("gpt_oss"), num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                intermediate_size=64)  # fmt: skip


def laguna() -> dict:
    """Laguna: full and sliding layers, gated attention heads, sigmoid-routed experts with a shared one."""
    return dict(_base("laguna"), sliding_window=WINDOW,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=32)  # fmt: skip


CONFIGS = {
    f.__name__: f for f in (qwen3_moe, llama, gemma4_text, gemma4_ple, gemma4, gpt_oss, laguna)
}


def random_sinks(model) -> None:
    """gpt-oss's per-head sink logits, seeded and large enough to take a real share of each
    softmax (mlx-lm initialises them to zero, and the seeded weights touch matrices only)."""
    import mlx.core as mx

    for i, layer in enumerate(model.model.layers):
        heads = layer.self_attn.sinks.shape[0]
        layer.self_attn.sinks = mx.random.normal((heads,), key=mx.random.key(100 + i)) * 2.0


ADJUST = {"gpt_oss": random_sinks}
# Seeds of the saved weights. Laguna's seed 3 puts two logits within 2e-6 of each other on a test
# prompt, where mlx-lm's own one-pass and step-by-step decoding already disagree: no reference.
SEEDS = {"laguna": 5}
