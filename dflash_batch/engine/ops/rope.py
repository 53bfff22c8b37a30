"""Per-token RoPE positions: a draft tree's verify pass (engine/tree.py) runs each node at its
row's length plus its depth, so an attention layer's rotary embedding takes one offset per token.
The caches hand these out while a tree is verified; the target wraps its layers' RoPE."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn


class TokenPositions:
    """RoPE positions of a tree pass, one per token [B, T] (``RaggedKVCache.offset`` gives these
    while a tree is verified)."""

    def __init__(self, positions: mx.array):
        self.positions = positions


class TokenRoPE(nn.Module):
    """An attention layer's RoPE that also takes one position per token: each token is rotated
    as a one-token sequence at its own offset (the same rotation the layer applies to a whole
    sequence, position by position)."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, TokenPositions):
            return self.rope(x, offset=offset)
        B, H, T, D = x.shape
        flat = x.transpose(0, 2, 1, 3).reshape(B * T, H, 1, D)
        out = self.rope(flat, offset=offset.positions.reshape(-1))
        return out.reshape(B, T, H, D).transpose(0, 2, 1, 3)


def wrap_ropes(layers: Sequence[nn.Module]) -> bool:
    """Give every attention layer a ``TokenRoPE``; returns whether all of them could take one (a
    target whose layers keep RoPE elsewhere verifies chains only)."""
    attentions = [getattr(getattr(layer, "layer", layer), "self_attn", None) for layer in layers]
    if not attentions or any(
        a is None or not isinstance(getattr(a, "rope", None), nn.Module) for a in attentions
    ):
        return False
    for a in attentions:
        if not isinstance(a.rope, TokenRoPE):
            a.rope = TokenRoPE(a.rope)
    return True
