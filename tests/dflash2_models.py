"""Tiny seeded DFlash 2 drafters in the published on-disk format, for tests.

The checkpoint is written from the format's own list of tensor names and shapes
(../shared/research/dflash2-format.md, section 2), not from the engine's module tree, so that a
strict load by the engine checks its names against the published ones. ``reference_drafts`` is
an independent forward pass of the published model in numpy, written from the same description.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

ARCHITECTURE = "DFlash2DraftModel"


def dflash2_config(
    target_config: dict,
    layers: int = 2,
    block_size: int = 8,
    mask_token_id: int = 3,
    kernel: int = 2,
    group: int = 16,
    rank: int = 16,
    top_k: int = 8,
    runtime_block_size: Optional[int] = None,
    sliding_window: Optional[int] = None,
    target_layer_ids: Optional[List[int]] = None,
    **extra,
) -> dict:
    """A config.json as a published DFlash 2 checkpoint has it (qwen3 backbone keys at the top,
    the DFlash keys in ``dflash_config``); ``extra`` goes into ``dflash_config`` too."""
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    n_target = target_config["num_hidden_layers"]
    taps = target_layer_ids or sorted({1, n_target // 2, n_target - 1})
    dflash = {"block_size": block_size, "mask_token_id": mask_token_id, "target_layer_ids": taps,
              "conv_kernel_size": kernel, "conv_group_size": group, "selector_rank": rank,
              "selector_top_k": top_k, **extra}  # fmt: skip
    if runtime_block_size is not None:
        dflash["runtime_block_size"] = runtime_block_size
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": target_config["intermediate_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": target_config.get("num_key_value_heads", heads),
        "head_dim": target_config.get("head_dim") or hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": target_config["vocab_size"],
        "num_target_layers": n_target,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        "attention_bias": False,
        "hidden_act": "silu",
        "is_causal": False,
        "tie_word_embeddings": True,
        "dtype": "float32",
        "dflash_config": dflash,
    }
    if sliding_window:
        cfg["layer_types"] = ["sliding_attention"] * layers
        cfg["sliding_window"] = sliding_window
    return cfg


def published_shapes(config: dict) -> Dict[str, tuple]:
    """Every tensor of a DFlash 2 checkpoint, by its published name: [out, in] linears, bare codebooks."""
    d = config["dflash_config"]
    H, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nH, nKV, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    K, G, R = d["conv_kernel_size"], H // d["conv_group_size"], d["selector_rank"]
    shapes = {
        "fc.weight": (H, len(d["target_layer_ids"]) * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
        "candidate_selector.hidden_projection.weight": (R, H),
        "candidate_selector.predecessor_codebook": (V, R),
        "candidate_selector.successor_codebook": (V, R),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nH * hd, H), p + "self_attn.k_proj.weight": (nKV * hd, H),
            p + "self_attn.v_proj.weight": (nKV * hd, H), p + "self_attn.o_proj.weight": (H, nH * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
            p + "attention_conv.base_kernel": (2, K, H), p + "attention_conv.kernel_projection.weight": (2 * K * G, H),
            p + "mlp_conv.base_kernel": (2, K, H), p + "mlp_conv.kernel_projection.weight": (2 * K * G, H),
        })  # fmt: skip
    return shapes


def random_weights(
    config: dict, seed: int = 1, codebook_scale: float = 0.5
) -> Dict[str, np.ndarray]:
    """Seeded weights: matrices N(0, 1/fan_in), norms 1 + N(0, 0.1), base kernels N(0, 0.5), codebooks
    N(0, codebook_scale) (pair scores about as large as the logits: the selector matters)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in published_shapes(config).items():
        if name.endswith("codebook"):
            w = codebook_scale * rng.standard_normal(shape)
        elif name.endswith("base_kernel"):
            w = 0.5 * rng.standard_normal(shape)
        elif len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def save_dflash2(
    folder: Path, config: dict, seed: int = 1, weights: Optional[Dict[str, np.ndarray]] = None
) -> Path:
    import mlx.core as mx

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed) if weights is None else weights
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        {k: mx.array(v) for k, v in weights.items()},
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# -- an independent reference of the published forward pass (numpy, float64) -------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    """Rotate-half RoPE (non-interleaved) of x [..., T, d] at integer positions [T]."""
    d = x.shape[-1]
    freqs = theta ** (-np.arange(0, d, 2) / d)
    angle = positions[:, None] * freqs[None]
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _conv(v, base, dynamic, group):
    """sum_t (base[t, c] + dynamic[i, t, c // group]) * v[i - t, c], zero before the block's start."""
    L, H = v.shape
    out = np.zeros_like(v)
    for i in range(L):
        for t in range(base.shape[0]):
            if i - t >= 0:
                out[i] += (base[t] + np.repeat(dynamic[i, t], group)) * v[i - t]
    return out


def _attention(u, ctx, W, p, cfg, window):
    """Block rows u [L, H] attend over [context (positions 0..S-1) ; block (S..S+L-1)], no mask
    but the window on context keys: query S+i sees context key j iff S+i-j < window."""
    nH, nKV, hd, eps = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
    )
    theta = cfg["rope_parameters"]["rope_theta"]
    L, S = u.shape[0], ctx.shape[0]
    rows = np.concatenate([ctx, u])
    q = (u @ W[p + "q_proj.weight"].T).reshape(L, nH, hd).transpose(1, 0, 2)
    k = (rows @ W[p + "k_proj.weight"].T).reshape(S + L, nKV, hd).transpose(1, 0, 2)
    v = (rows @ W[p + "v_proj.weight"].T).reshape(S + L, nKV, hd).transpose(1, 0, 2)
    q = _rope(_rms(q, W[p + "q_norm.weight"], eps), np.arange(S, S + L), theta)
    k = _rope(_rms(k, W[p + "k_norm.weight"], eps), np.arange(S + L), theta)
    rep = nH // nKV
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    scores = q @ k.transpose(0, 2, 1) * hd**-0.5  # [nH, L, S + L]
    if window:
        query = S + np.arange(L)[:, None]
        key = np.arange(S + L)[None]
        scores = np.where((key >= S) | (query - key < window), scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(L, nH * hd)
    return out @ W[p + "o_proj.weight"].T


def reference_hidden(W, cfg, context, block_embeddings):
    """The drafter's normed output [L, H] for one row: tapped target context [S, taps*H] (all of
    the row's context, positions 0..S-1) and the embedded block [L, H]."""
    W = {k: np.asarray(v, dtype=np.float64) for k, v in W.items()}
    d, eps = cfg["dflash_config"], cfg["rms_norm_eps"]
    K, GS = d["conv_kernel_size"], d["conv_group_size"]
    H = cfg["hidden_size"]
    ctx = _rms(np.asarray(context, np.float64) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    x = np.asarray(block_embeddings, np.float64) * float(d.get("input_embedding_scale", 1.0))
    L = x.shape[0]
    window = cfg.get("sliding_window")
    for n, kind in enumerate(
        cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    ):
        p = f"layers.{n}."
        for conv, norm, sub in (
            ("attention_conv", "input_layernorm", "attn"),
            ("mlp_conv", "post_attention_layernorm", "mlp"),
        ):
            z = _rms(x, W[p + norm + ".weight"], eps)
            dyn = (z @ W[p + conv + ".kernel_projection.weight"].T).reshape(L, 2, K, H // GS)
            base = W[p + conv + ".base_kernel"]
            u = _conv(z, base[0], dyn[:, 0], GS)
            if sub == "attn":
                y = _attention(
                    u,
                    ctx,
                    W,
                    p + "self_attn.",
                    cfg,
                    window if kind == "sliding_attention" else None,
                )
            else:
                gate, up = u @ W[p + "mlp.gate_proj.weight"].T, u @ W[p + "mlp.up_proj.weight"].T
                y = (gate / (1 + np.exp(-gate)) * up) @ W[p + "mlp.down_proj.weight"].T
            x = x + _conv(y, base[1], dyn[:, 1], GS)
    return _rms(x, W["norm.weight"], eps)


def reference_select(W, cfg, h, logits, first: int, pairwise: bool = True) -> List[int]:
    """The selector's walk for one row: h [P, H], the head's logits [P, V] -> P draft ids."""
    d = cfg["dflash_config"]
    logits = np.asarray(logits, np.float64) * float(d.get("output_multiplier", 1.0))
    cap = d.get("final_logit_softcapping")
    if cap:
        logits = np.tanh(logits / cap) * cap
    A = np.asarray(W["candidate_selector.predecessor_codebook"], np.float64)
    B = np.asarray(W["candidate_selector.successor_codebook"], np.float64)
    P = (
        np.asarray(h, np.float64)
        @ np.asarray(W["candidate_selector.hidden_projection.weight"], np.float64).T
    )
    k = min(d["selector_top_k"], logits.shape[-1])
    prev, out = first, []
    for i in range(h.shape[0]):
        cands = np.argsort(-logits[i], kind="stable")[:k]
        score = logits[i, cands] + (B[cands] @ (A[prev] * P[i]) if pairwise else 0.0)
        prev = int(cands[int(np.argmax(score))])
        out.append(prev)
    return out


def bigram_selector(drafter, target, successor: np.ndarray, strength: float = 100.0) -> None:
    """Make a loaded DFlash 2 drafter propose ``successor[prev]`` after every token prev (where it
    it is: the unary scores are zeroed and top-k is widened to the whole vocabulary): its sublayers' outputs zeroed,
    the mask rows' output h0 is one vector, the projection maps it to ones, and the codebooks hold
    the bigram table (predecessor = identity, successor[c, prev] = 1 iff c == successor[prev])."""
    import mlx.core as mx

    for layer in drafter.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    V = len(successor)
    mask = mx.array([[drafter.args.mask_token_id]])
    h0 = drafter.norm(target.embed(mask) * drafter.args.input_embedding_scale)[0, 0].astype(
        mx.float32
    )
    sel = drafter.candidate_selector
    sel.hidden_projection = type(sel.hidden_projection)(h0.shape[0], V, bias=False)
    sel.hidden_projection.weight = mx.broadcast_to(h0[None] / mx.sum(h0 * h0), (V, h0.shape[0]))
    sel.predecessor_codebook = mx.eye(V) * strength
    table = np.zeros((V, V), np.float32)
    table[np.asarray(successor), np.arange(V)] = 1.0
    sel.successor_codebook = mx.array(table)
    sel.top_k = V
    drafter.args.output_multiplier = 0.0  # no unary scores: the table alone decides
    mx.eval(drafter.parameters())
