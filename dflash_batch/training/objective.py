"""The DFlash training objective, packed: many anchor blocks per sequence in one pass.

Inference (engine/decode.py) drafts from an anchor position p: the block is
``[x_p, MASK x (B-1)]`` at positions p..p+B-1, the drafter sees the target's tapped hidden
states of positions < p as extra keys/values, and block position k predicts x_{p+k}.
Training does exactly that for A anchors per sequence at once (drawn at random; with the
trainer's ``follow_anchors``, some where decoding would anchor next after drawn ones):

    keys    = [context rows 0..T-1] ++ [all A*B block rows]
    visible = context row s for an anchor-p block row iff s < p;  block rows of the same anchor
    loss    = sum_k w_k CE(lm_head(h_{p,k}), x_{p+k}) / sum_k w_k,   w_k = exp(-(k-1)/gamma)

With distillation (share alpha), each position's loss also reads the target's own distribution
there, t_{p,k} = softmax(target logits at position p+k-1), whose argmax the label x_{p+k} is
(greedy answers):

    loss_k  = (1 - alpha) CE(q_{p,k}, x_{p+k}) + alpha H(t_{p,k}, q_{p,k}),   H(t, q) = -sum_v t_v log q_v

The target's embedding and LM head are frozen inputs, never drafter parameters.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


# -- batches (numpy: host-side sampling) ------------------------------------------------------
def sample_anchors(
    rng: np.random.Generator, prompt_len: int, total_len: int, count: int
) -> np.ndarray:
    """``count`` anchor positions p in the answer with at least one label (p + 1 < total_len).

    The first anchor is the last prompt position's successor, as after prefill; distinct
    positions when the answer is long enough, repeats otherwise.
    """
    low, high = max(prompt_len, 1), total_len - 1  # p in [low, high)
    if high <= low:
        return np.full(count, -1, dtype=np.int64)  # no usable anchor: every weight is zero
    span = high - low
    picks = rng.choice(span, size=count, replace=span < count)
    return np.sort(low + picks)


def make_batch(
    samples: Sequence[dict],
    rng: np.random.Generator,
    anchors_per_seq: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    max_len: int,
    pad_to: int = 64,
) -> Dict[str, np.ndarray]:
    """Host arrays for one step: tokens [N, T], anchors [N, A], block ids [N, A, B],
    labels and weights [N, A, B-1], and each sequence's length [N]."""
    seqs = [(s["prompt"] + s["answer"])[:max_len] for s in samples]
    T = max(len(x) for x in seqs)
    T = int(math.ceil(T / pad_to) * pad_to)  # few distinct shapes
    tokens = np.zeros((len(seqs), T), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
    lengths = np.array([len(x) for x in seqs], dtype=np.int64)
    anchors = np.stack(
        [
            sample_anchors(rng, min(len(s["prompt"]), len(x)), len(x), anchors_per_seq)
            for s, x in zip(samples, seqs)
        ]
    )
    return blocks_at(tokens, lengths, anchors, block_size, mask_token_id, gamma)


def blocks_at(
    tokens: np.ndarray,
    lengths: np.ndarray,
    anchors: np.ndarray,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Dict[str, np.ndarray]:
    """The blocks, labels and weights of anchors [N, A] (-1: none, every weight zero) over
    tokens [N, T] whose first ``lengths`` ids are the sequence."""
    N, A, B = anchors.shape[0], anchors.shape[1], block_size
    decay = np.exp(-np.arange(B - 1, dtype=np.float32) / gamma)  # w_k for k = 1..B-1
    pos = anchors[:, :, None] + np.arange(1, B)[None, None, :]  # p + k
    has = (anchors[:, :, None] >= 0) & (pos < lengths[:, None, None])
    at = np.take_along_axis(tokens, pos.clip(0, tokens.shape[1] - 1).reshape(N, -1), axis=1)
    labels = np.where(has, at.reshape(pos.shape), 0)  # x_{p+k}
    weights = np.where(has, decay[None, None, :], 0.0).astype(np.float32)
    block = np.full((N, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(tokens, anchors.clip(0), axis=1)
    return {
        "tokens": tokens,
        "lengths": lengths,
        "anchors": anchors.clip(0).astype(np.int32),
        "block": block,
        "labels": labels.astype(np.int32),
        "weights": weights,
    }


def accepted_drafts(logits: mx.array, labels: mx.array, weights: mx.array) -> mx.array:
    """Per anchor block [N, A]: the drafts greedy verification would accept, the run of leading
    block positions whose argmax is the label."""
    return leading_matches(mx.argmax(logits, axis=-1), labels, weights)


def leading_matches(drafts: mx.array, labels: mx.array, weights: mx.array) -> mx.array:
    """Per anchor block [N, A]: the run of leading block positions whose draft id is the label
    (positions of weight zero, past the text, never match)."""
    correct = (drafts == labels) & (weights > 0)
    return mx.cumprod(correct.astype(mx.int32), axis=-1).sum(axis=-1)


def follow_up_anchors(
    anchors: np.ndarray, accepted: np.ndarray, valid: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """Where decoding anchors its next block after a block at p accepted a drafts: p + a + 1,
    the target's bonus token, right after the draft it overruled. -1 where the block had no label
    or no label would follow the new anchor (p' + 1 >= length)."""
    nxt = anchors.astype(np.int64) + accepted.astype(np.int64) + 1
    ok = valid & (nxt + 1 < lengths[:, None])
    return np.where(ok, nxt, -1)


def attention_mask(anchors: mx.array, context_len: int, block_size: int) -> mx.array:
    """Boolean [N, 1, A*B, T + A*B]: what each block row may attend to."""
    N, A = anchors.shape
    B = block_size
    row_anchor = mx.repeat(anchors, B, axis=1)  # [N, A*B]: the anchor p of each block row
    ctx = mx.arange(context_len)[None, None, :] < row_anchor[:, :, None]  # context s < p
    owner = mx.repeat(mx.arange(A), B)
    same = owner[:, None] == owner[None, :]  # block rows of the same anchor see each other
    same = mx.broadcast_to(same[None], (N, A * B, A * B))
    return mx.concatenate([ctx, same], axis=2)[:, None]


# -- the drafter's forward over packed blocks ---------------------------------------------------
def _heads(x: mx.array, n: int, head_dim: int) -> mx.array:
    N, L, _ = x.shape
    return x.reshape(N, L, n, head_dim).transpose(0, 2, 1, 3)


def _rope_blocks(rope, x: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """RoPE for block rows: row k of anchor p sits at position p + k (one offset per block)."""
    N, H, L, D = x.shape
    A = anchors.shape[1]
    x = x.reshape(N, H, A, block_size, D).transpose(0, 2, 1, 3, 4).reshape(N * A, H, block_size, D)
    x = rope(x, offset=anchors.reshape(-1))
    return x.reshape(N, A, H, block_size, D).transpose(0, 2, 1, 3, 4).reshape(N, H, L, D)


def _attention(
    attn, x: mx.array, ctx: mx.array, anchors: mx.array, mask: mx.array, block_size: int
) -> mx.array:
    """The drafter layer's attention with every anchor block at once (same maths as
    drafter.Attention with a fresh cache holding the anchor's context)."""
    N, L, _ = x.shape
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = _rope_blocks(attn.rope, attn.q_norm(_heads(attn.q_proj(x), nh, hd)), anchors, block_size)
    k_blk = _rope_blocks(
        attn.rope, attn.k_norm(_heads(attn.k_proj(x), nkv, hd)), anchors, block_size
    )
    v_blk = _heads(attn.v_proj(x), nkv, hd)
    # context row s at position s
    k_ctx = attn.rope(attn.k_norm(_heads(attn.k_proj(ctx), nkv, hd)), offset=0)
    v_ctx = _heads(attn.v_proj(ctx), nkv, hd)
    keys = mx.concatenate([k_ctx, k_blk], axis=2)
    values = mx.concatenate([v_ctx, v_blk], axis=2)
    # Grouped heads: query head h reads key/value head h // (nh / nkv).
    rep = nh // nkv
    q = q.reshape(N, nkv, rep, L, hd)
    scores = (q * attn.scale) @ keys[:, :, None].swapaxes(-1, -2)  # [N, kv, rep, L, S]
    scores = mx.where(mask[:, :, None], scores.astype(mx.float32), -1e30)
    probs = mx.softmax(scores, axis=-1).astype(values.dtype)
    out = (probs @ values[:, :, None]).reshape(N, nh, L, hd)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))


def packed_forward(
    drafter, block_embeddings: mx.array, context: mx.array, anchors: mx.array
) -> mx.array:
    """Drafter hidden states [N, A*B, H] for all anchor blocks of a batch."""
    B = drafter.args.block_size
    if any(t != "full_attention" for t in drafter.args.layer_types):
        raise ValueError("training supports full-attention drafter layers only")
    ctx = drafter.hidden_norm(drafter.fc(context))  # concat(taps) -> fc -> RMSNorm
    mask = attention_mask(anchors, context.shape[1], B)
    x = block_embeddings
    for layer in drafter.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), ctx, anchors, mask, B)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


# -- loss ------------------------------------------------------------------------------------
def block_logits(drafter, lm_head, block_embeddings, context, anchors) -> mx.array:
    """Logits [N, A, B-1, V] of block positions 1..B-1."""
    N, A = anchors.shape
    B = drafter.args.block_size
    h = packed_forward(drafter, block_embeddings, context, anchors).reshape(N, A, B, -1)
    return lm_head(h[:, :, 1:, :])


def dflash_loss(
    drafter, lm_head, block_embeddings, context, anchors, labels, weights, teacher=None, distill=0.0
):
    """Position-weighted cross-entropy (the DFlash objective) and the weight total; with
    ``teacher`` (the target's logits [N, A, B-1, V] where it predicts each label: ``teacher_positions``),
    a share ``distill`` of each position's loss is the cross-entropy to the target's distribution."""
    logits = block_logits(drafter, lm_head, block_embeddings, context, anchors).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    if teacher is not None and distill > 0:
        t = mx.softmax(mx.stop_gradient(teacher).astype(mx.float32), axis=-1)
        # H(t, q)
        soft = -(t * (logits - mx.logsumexp(logits, axis=-1, keepdims=True))).sum(axis=-1)
        ce = (1.0 - distill) * ce + distill * soft
    total = weights.sum()
    return (ce * weights).sum() / mx.maximum(total, 1e-6), total


def teacher_positions(anchors: mx.array, block_size: int, length: int) -> mx.array:
    """[N, A, B-1]: the position p+k-1 whose target logits predict block position k's label
    x_{p+k} (k = 1..B-1), clipped into the sequence (positions past it have weight zero)."""
    pos = anchors[:, :, None] + mx.arange(block_size - 1, dtype=anchors.dtype)[None, None, :]
    return mx.clip(pos, 0, length - 1)


def acceptance_stats(logits: mx.array, labels: mx.array, weights: mx.array) -> Dict[str, float]:
    """Teacher-forced greedy acceptance: per anchor, the run of leading correct positions + 1."""
    drafts = mx.argmax(logits, axis=-1)
    run = leading_matches(drafts, labels, weights)
    has = weights[..., 0] > 0
    n = mx.maximum(has.sum(), 1)
    tau = ((run + 1) * has).sum() / n
    acc1 = ((drafts[..., 0] == labels[..., 0]) & has).sum() / n
    return {"tau": float(tau.item()), "acc_pos1": float(acc1.item())}


def tap_ids_for(num_target_layers: int, count: int) -> List[int]:
    from ..engine.models.drafter import build_target_layer_ids

    return build_target_layer_ids(num_target_layers, count)


def to_mx(batch: Dict[str, np.ndarray]) -> Dict[str, mx.array]:
    return {k: mx.array(v) for k, v in batch.items()}
