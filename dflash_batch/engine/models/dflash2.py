"""The DFlash 2 drafter (``architectures: ["DFlash2DraftModel"]``), in the published on-disk format.

DFlash v1's body (engine/models/drafter.py: the block ``[last, MASK x (B-1)]`` embedded with the
target's embeddings, tapped target context as extra keys and values, no embeddings or head of
its own) with two changes:

* Every sublayer is wrapped in a dynamic depthwise convolution over the block's positions
  (``attention_conv``, ``mlp_conv``). With z the sublayer's normed input, K taps and channel c in
  group g(c) = c // GS:

      [d_prepare | d_finish] = kernel_projection(z)          # [L, 2, K, G]: computed once, from z
      conv_j(v)[i, c] = sum_t (base_kernel[j, t, c] + d_j[i, t, g(c)]) * v[i - t, c]
      x = x + conv_finish(sublayer(conv_prepare(z)))

  v[i - t] is zero before the block's first position: the taps read this block only, so the
  convolutions keep no state from one cycle to the next (rollback touches the context K/V alone).
* Sliding-window layers window the context only; the block itself is bidirectional.

The drafts are chosen by the candidate selector, a low-rank pairwise walk over each position's
top-k tokens of the target's head: from prev = the block's first token,

    score_i(c) = logit_i(c) + sum_r predecessor[prev, r] * P_i[r] * successor[c, r],  P = hidden_projection(h)
    d_i = argmax over the top-k c of score_i(c); prev = d_i

The codebooks are bare [V, R] tensors (no ``.weight``), as published. The path is a proposal:
verification decides what is kept, so output is the target's whatever it proposes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from . import drafter

ARCHITECTURE = "DFlash2DraftModel"
REQUIRED_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# the runtime ceiling when a config names none (the reference loaders' rule)
DEFAULT_RUNTIME_BLOCK = 5


@dataclass
class ModelArgs(drafter.ModelArgs):
    conv_kernel_size: int = 0
    conv_group_size: int = 0  # channels per group of the dynamic kernel
    selector_rank: int = 0
    selector_top_k: int = 0
    final_logit_softcapping: Optional[float] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "ModelArgs":
        """v1's keys (engine/models/drafter.py) plus ``dflash_config``'s DFlash 2 keys; every
        inconsistency is named before any weight is read."""
        nested = config.get("dflash_config")
        if not isinstance(nested, Mapping):
            raise ValueError("a DFlash 2 drafter config.json needs a dflash_config object")
        missing = [k for k in REQUIRED_KEYS if k not in nested]
        if missing:
            raise KeyError(
                f"DFlash 2 drafter config.json: dflash_config is missing {', '.join(missing)}"
            )
        if config.get("vocab_size") is None:
            raise KeyError(
                "DFlash 2 drafter config.json is missing 'vocab_size' (it sizes the selector's codebooks)"
            )
        if config.get("is_causal", False):
            raise ValueError(
                "DFlash 2 drafter config.json sets is_causal: DFlash 2 blocks are bidirectional"
            )
        base = drafter.ModelArgs.from_config(config)
        args = cls(**{f.name: getattr(base, f.name) for f in fields(base)},
                   conv_kernel_size=int(nested["conv_kernel_size"]), conv_group_size=int(nested["conv_group_size"]),
                   selector_rank=int(nested["selector_rank"]), selector_top_k=int(nested["selector_top_k"]),
                   final_logit_softcapping=nested.get("final_logit_softcapping"),
                   input_embedding_scale=float(nested.get("input_embedding_scale", 1.0)),
                   output_multiplier=float(nested.get("output_multiplier", 1.0)))  # fmt: skip
        runtime = nested.get("runtime_block_size")
        args.runtime_block_size = (
            int(runtime) if runtime is not None else min(DEFAULT_RUNTIME_BLOCK, args.block_size)
        )
        args.check()
        return args

    def check(self) -> None:
        problems = []
        if self.conv_kernel_size < 1 or self.selector_rank < 1:
            problems.append("conv_kernel_size and selector_rank must be positive")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            problems.append(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}"
            )
        if not 0 < self.selector_top_k <= self.vocab_size:
            problems.append(
                f"selector_top_k {self.selector_top_k} must be in 1..vocab_size ({self.vocab_size})"
            )
        if not 2 <= self.runtime_block_size <= self.block_size:
            problems.append(
                f"runtime_block_size {self.runtime_block_size} must be in 2..block_size ({self.block_size})"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            problems.append("sliding_attention layers need sliding_window")
        if problems:
            raise ValueError("DFlash 2 drafter config.json: " + "; ".join(problems))


class DynamicConv(nn.Module):
    """The two grouped dynamic depthwise convolutions around one sublayer (module doc)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, hidden))  # [prepare | finish, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, z: mx.array):
        """conv_prepare(z), and the finishing convolution's dynamic kernel (both from z)."""
        B, L, H = z.shape
        dynamic = self.kernel_projection(z).reshape(B, L, 2, self.kernel, H // self.group)
        return self._convolve(z, dynamic[:, :, 0], 0), dynamic[:, :, 1]

    def finish(self, v: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(v, dynamic, 1)

    def _convolve(self, v: mx.array, dynamic: mx.array, which: int) -> mx.array:
        L = v.shape[1]
        # [B, L, K, H]
        taps = self.base_kernel[which].astype(v.dtype) + mx.repeat(dynamic, self.group, axis=-1)
        out = taps[:, :, 0] * v
        for t in range(1, min(self.kernel, L)):
            # v shifted down t positions, zeros before the block's start: nothing from earlier cycles
            shifted = mx.pad(v[:, : L - t], [(0, 0), (t, 0), (0, 0)])
            out = out + taps[:, :, t] * shifted
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool):
        super().__init__()
        self.self_attn = drafter.Attention(args, sliding)
        # the window bounds the context; the block stays bidirectional
        self.self_attn.causal = False
        self.mlp = drafter.MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attention_conv = DynamicConv(
            args.hidden_size, args.conv_kernel_size, args.conv_group_size
        )
        self.mlp_conv = DynamicConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(
        self, x: mx.array, ctx: mx.array, cache, counts: Optional[mx.array] = None
    ) -> mx.array:
        u, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(u, ctx, cache, counts), kernel)
        u, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(u), kernel)


class CandidateSelector(nn.Module):
    """The low-rank pairwise path over each position's top-k candidates (module doc)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.selector_top_k
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)
        self.predecessor_codebook = mx.zeros((args.vocab_size, args.selector_rank))
        self.successor_codebook = mx.zeros((args.vocab_size, args.selector_rank))

    def __call__(self, h: mx.array, logits: mx.array, first: mx.array) -> mx.array:
        """Hidden [B, P, H], logits [B, P, V] and the block's first token [B, 1] -> drafts [B, P]."""
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]  # [B, P, k], unordered
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(h)  # [B, P, R]
        prev = first[:, 0]
        picks = []
        for i in range(h.shape[1]):  # sequential, but each step is a [B, k, R] product
            query = self.predecessor_codebook[prev] * projected[:, i]  # [B, R]
            pair = (self.successor_codebook[candidates[:, i]] @ query[:, :, None])[..., 0]  # [B, k]
            pick = mx.argmax(unary[:, i] + pair, axis=-1)
            prev = mx.take_along_axis(candidates[:, i], pick[:, None], axis=-1)[:, 0]
            picks.append(prev)
        return mx.stack(picks, axis=1)


class Model(drafter.Model):
    """The DFlash 2 body: v1's interface (``draft_pass``, ``add_context``, ``make_cache``), its
    own layers, and ``propose`` in place of the argmax of the head."""

    layer_class = DecoderLayer
    selects = True  # one path per row (``propose``): cycles verify chains, never trees

    def __init__(self, args: ModelArgs, target_hidden_size: Optional[int] = None):
        super().__init__(args, target_hidden_size)
        self.candidate_selector = CandidateSelector(args)

    def __call__(
        self, x: mx.array, context: mx.array, cache: list, counts: Optional[mx.array] = None
    ) -> mx.array:
        if self.args.input_embedding_scale != 1.0:
            x = x * self.args.input_embedding_scale
        return super().__call__(x, context, cache, counts)

    def propose(self, h: mx.array, logits: mx.array, first: mx.array) -> mx.array:
        """Drafts [B, P] from the drafter's output h [B, P, H], the target head's logits of it and
        the block's first token [B, 1]."""
        logits = logits.astype(mx.float32) * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return self.candidate_selector(h, logits, first)


def is_dflash2(config: Dict[str, Any]) -> bool:
    """Whether a drafter config.json is DFlash 2: by its architecture, or, with none named, by
    the DFlash 2 keys of its dflash_config."""
    architectures = config.get("architectures") or []
    if architectures:
        return ARCHITECTURE in architectures
    nested = config.get("dflash_config")
    return isinstance(nested, Mapping) and any(k in nested for k in REQUIRED_KEYS)
