"""The DFlash block-diffusion drafter, in the published z-lab on-disk format.

A few Qwen3-style decoder layers. The block ``[last token, MASK x (B-1)]`` is embedded with the
target's embeddings; hidden states tapped from the target are projected by ``fc`` and
``hidden_norm`` and enter every layer as extra keys and values (never as input rows). The
caller applies the target's LM head to the output, cut to the drafter's draft vocabulary if it
has one (``draft_vocab.json``; engine/decode.py: ``DraftHead``). The draft cache holds context
K/V (the block's rows are written past the context and never counted). Batches whose rows bring
different numbers of context rows take the ragged path (``Attention._ragged``); so does a
decoding cycle's pass where it is replayed from a trace (``draft_pass``: engine/ops/compiled.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..ops import compiled
from ..ops.attention import drafter_attention
from ..ops.batch_cache import Lengths, RaggedKVCache
from ..ops.kernels import cpu

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "rms_norm_eps",
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """The reference rule for tap layers when a config names none: spread over 1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = (end - start) / (num_draft_layers - 1)
    return [int(round(start + i * span)) for i in range(num_draft_layers)]


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    rope_theta: float = 1e6
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 32768
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    num_target_layers: Optional[int] = None
    vocab_size: Optional[int] = None
    attention_bias: bool = False
    draft_vocab: Optional[List[int]] = None  # target ids the drafter proposes (None: all of them)
    runtime_block_size: Optional[int] = None  # the engine's default block size (None: block_size)

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "ModelArgs":
        """Read both the flat (older) and nested ``dflash_config`` (newer) checkpoint styles."""
        missing = [k for k in REQUIRED_KEYS if k not in config]
        if missing:
            raise KeyError(f"drafter config.json is missing required key {missing[0]!r}")
        nested = config.get("dflash_config") or {}

        def pick(key, default=None):
            return nested.get(key, config.get(key, default))

        heads = config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        mask_token_id = pick("mask_token_id")
        if mask_token_id is None:
            raise KeyError(
                "drafter config.json is missing required key 'mask_token_id' (top level or dflash_config)"
            )
        taps = pick("target_layer_ids")
        if taps is None:
            n_target = config.get("num_target_layers")
            if n_target is None:
                raise KeyError(
                    "drafter config.json names neither 'target_layer_ids' nor 'num_target_layers'"
                )
            taps = build_target_layer_ids(n_target, layers)
        rope = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 1e6))
        rope_scaling = config.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        layer_types = list(config.get("layer_types") or ["full_attention"] * layers)
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        return cls(
            hidden_size=config["hidden_size"],
            num_hidden_layers=layers,
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            rms_norm_eps=config["rms_norm_eps"],
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(t) for t in taps],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            layer_types=layer_types,
            sliding_window=config.get("sliding_window"),
            num_target_layers=config.get("num_target_layers"),
            vocab_size=config.get("vocab_size"),
            attention_bias=bool(config.get("attention_bias", False)),
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        dim, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            hd,
        )
        self.scale = hd**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )
        self.window = args.sliding_window if sliding else None
        self.causal = sliding  # a sliding layer's block is causal (DFlash 2's is not: engine/models/dflash2.py)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(
        self, x: mx.array, ctx: mx.array, cache: RaggedKVCache, counts: Optional[mx.array] = None
    ) -> mx.array:
        """Attend the block ``x`` [B, L] over the cached context, first adding ``ctx`` [B, S]
        (new context rows; with ``counts``, row b brings only its first counts[b] of them)."""
        B, L, _ = x.shape
        S = ctx.shape[1]
        if counts is not None or not cache.lengths.uniform:
            return self._ragged(
                x, ctx, cache, counts if counts is not None else mx.full((B,), S, mx.int32)
            )
        start = cache.offset  # absolute position of the first new context row
        # The new context rows (positions start..start+S-1) and the block rows (start+S..) are
        # contiguous: one K/V projection, one norm and one RoPE serve both (fewer ops per pass).
        rows = mx.concatenate([ctx, x], axis=1)
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start + S)
        k = self.rope(self.k_norm(self._heads(self.k_proj(rows), self.n_kv_heads)), offset=start)
        v = self._heads(self.v_proj(rows), self.n_kv_heads)
        # The cache writes context and block; the engine then advances its length by S only, so
        # the block's rows stay unseen and the next pass overwrites them.
        keys, values = cache.update_and_fetch(k, v)
        # Keys sit at absolute positions 0..T+L-1 and queries at T..T+L-1 (T = context length).
        # Full layers: every query sees all context and the whole block (bidirectional).
        # Sliding layers: causal inside the block, context limited to the window.
        # (stock SDPA with that mask, or the two-pass block attention on GPU: engine/ops/attention.py)
        out = drafter_attention(
            q, keys, values, scale=self.scale, window=self.window, causal=self.causal
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _ragged(
        self, x: mx.array, ctx: mx.array, cache: RaggedKVCache, counts: mx.array
    ) -> mx.array:
        """Rows with their own context lengths n_b and new-context counts c_b.

        Where each row sits, and what each query sees:

            context row j of row b -> position n_b + j      (j < c_b; padding rows go past the block)
            block row i            -> position n_b + c_b + i (queries too)
            query i sees           -> keys j < n_b + c_b + L (full) or its window, causal (sliding):
                                      row b's keys end at kv_len[b] = n_b + c_b + L
        """
        B, L, _ = x.shape
        S = ctx.shape[1]
        start = cache.lengths.device
        first = start + counts  # position of each row's block
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=first)
        rows = mx.concatenate([ctx, x], axis=1)
        k = self.k_norm(self._heads(self.k_proj(rows), self.n_kv_heads))
        k_block = self.rope(k[:, :, S:], offset=first)
        k = (
            mx.concatenate([self.rope(k[:, :, :S], offset=start), k_block], axis=2)
            if S
            else k_block
        )
        v = self._heads(self.v_proj(rows), self.n_kv_heads)
        j = mx.arange(S, dtype=mx.int32)[None]
        ctx_cols = mx.where(j < counts[:, None], start[:, None] + j, start[:, None] + L + j)
        blk_cols = first[:, None] + mx.arange(L, dtype=mx.int32)[None]
        keys, values = cache.write_columns(
            mx.concatenate([ctx_cols, blk_cols], axis=1), k, v, S + L
        )
        out = drafter_attention(
            q,
            keys,
            values,
            scale=self.scale,
            window=self.window,
            kv_len=first + L,
            causal=self.causal,
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def context_kv(self, ctx: mx.array, start) -> tuple:
        """K/V of context rows alone (positions start..), for adding a prompt's context."""
        k = self.rope(self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads)), offset=start)
        return k, self._heads(self.v_proj(ctx), self.n_kv_heads)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(cpu.swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.self_attn = Attention(args, sliding)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self, x: mx.array, ctx: mx.array, cache: RaggedKVCache, counts: Optional[mx.array] = None
    ) -> mx.array:
        # ctx is shared by all layers and is not passed through input_layernorm.
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache, counts)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """Drafter body. ``__call__(block_embeddings, context_hidden, cache) -> hidden [B, L, H]``."""

    layer_class = DecoderLayer
    selects = False  # drafts are the head's argmax per position (DFlash 2 selects a path: engine/models/dflash2.py)

    def __init__(self, args: ModelArgs, target_hidden_size: Optional[int] = None):
        super().__init__()
        self.args = args
        th = target_hidden_size or args.hidden_size
        self.target_hidden_size = th
        self.fc = nn.Linear(len(args.target_layer_ids) * th, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, t == "sliding_attention") for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.passes = compiled.CompiledDraft(self)  # a plain attribute: not in the parameter tree

    def make_cache(
        self, lengths: Optional[Lengths] = None, capacity: int = 0
    ) -> List[RaggedKVCache]:
        """Context K/V per layer (``capacity`` positions allocated at first use); ``lengths``
        (context rows per batch row) is advanced by the caller. None: one empty row, for a single pass."""
        lengths = Lengths([0]) if lengths is None else lengths
        return [RaggedKVCache(lengths, capacity) for _ in self.layers]

    def __call__(
        self,
        x: mx.array,
        context: mx.array,
        cache: List[RaggedKVCache],
        counts: Optional[mx.array] = None,
    ) -> mx.array:
        """Block embeddings [B, L, H] and new context rows [B, S, taps*H] -> hidden [B, L, H].

        ``counts``: row b brings only its first counts[b] context rows (ragged batches)."""
        if context.shape[1]:
            ctx = self.hidden_norm(self.fc(context))  # concat(taps) -> fc -> RMSNorm
        else:  # no new context (rows that just joined): no zero-row matmul (quantized fc rejects it)
            ctx = mx.zeros((x.shape[0], 0, x.shape[2]), x.dtype)
        for layer, c in zip(self.layers, cache):
            x = layer(x, ctx, c, counts)
        return self.norm(x)

    def draft_pass(
        self,
        x: mx.array,
        context: mx.array,
        cache: List[RaggedKVCache],
        counts: Optional[mx.array] = None,
    ) -> mx.array:
        """A decoding cycle's drafter pass: ``__call__``, replayed from a trace where it can be
        (engine/ops/compiled.py)."""
        return self.passes(x, context, cache, counts)

    def add_context(self, context: mx.array, cache: List[RaggedKVCache]) -> None:
        """Write context rows [B, S, taps*H] into the cache without drafting (a prompt joining)."""
        ctx = self.hidden_norm(self.fc(context))
        for layer, c in zip(self.layers, cache):
            k, v = layer.self_attn.context_kv(ctx, c.offset)
            c.update_and_fetch(k, v)
