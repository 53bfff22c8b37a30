"""The target model: an mlx-lm model whose chosen layers report their outputs.

Capture wraps the tapped layers in place, so the model runs its own forward and the logits
are the ones ``model(...)`` gives, bit for bit. Works for models built as
``model.model.layers`` (llama, qwen2, qwen3, qwen3_moe, gemma4_text, gpt_oss, laguna, ...) and
``model.language_model.model.layers`` (qwen3_5).

The families and what each needs are in docs/models.md, "Target families".
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..ops import compiled, matmul, rope
from ..ops.batch_cache import Lengths, RaggedKVCache
from . import hybrid


class _Tap(nn.Module):
    """Runs a decoder layer and stores its output (the pre-norm residual stream) in ``store``."""

    def __init__(self, layer: nn.Module, store: List[Optional[mx.array]], slot: int):
        super().__init__()
        self.layer = layer
        # Plain attributes: a list set on an nn.Module would join its parameter tree.
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_slot", slot)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self:
                raise
            return getattr(self["layer"], name)  # e.g. is_linear on qwen3_5 layers

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        # gemma4_text layers return (hidden, shared K/V, offset): the hidden state is the tap
        self._store[self._slot] = out[0] if isinstance(out, tuple) else out
        return out


# mlx-lm model files whose logits are the LM head (or the tied embedding) applied to the backbone's
# output, nothing else (no logit scaling or soft-capping); others run their own forward whole.
HEAD_AFTER_BACKBONE = {
    f"mlx_lm.models.{name}"
    for name in ("qwen3", "qwen2", "llama", "qwen3_5", "qwen3_moe", "gpt_oss", "laguna")
}
# gemma4_text is not one: its logits are soft-capped (tanh) after the head. Its layers also turn the
# cache's offset into an array themselves, which a draft tree's per-token positions cannot pass.
NO_TREES = {"mlx_lm.models.gemma4_text"}


def _inner_model(model: nn.Module) -> Tuple[nn.Module, nn.Module]:
    """(the module that holds lm_head or ties it, the module that holds embed_tokens and layers).

    ``language_model`` first: qwen3_5.Model also answers ``.model`` (a property), but its
    ``lm_head`` lives on ``language_model``."""
    for outer in (getattr(model, "language_model", None), model):
        if outer is None:
            continue
        inner = getattr(outer, "model", None)
        if inner is not None and hasattr(inner, "layers") and hasattr(inner, "embed_tokens"):
            return outer, inner
    raise TypeError(
        f"unsupported target {type(model).__module__}: expected model.model.layers "
        "or model.language_model.model.layers with embed_tokens"
    )


class Target:
    """A loaded target model with hidden-state capture at ``tap_ids`` (0-based layer indices)."""

    def __init__(self, model: nn.Module, tap_ids: Sequence[int] = ()):
        self.model = model
        self._outer, self._inner = _inner_model(model)
        # the model's logits are lm_head(backbone(x)) and nothing more, so the head can run on chosen positions
        self.head_after_backbone = type(self._outer).__module__ in HEAD_AFTER_BACKBONE
        self.hybrid = hybrid.attach(model) > 0  # qwen3_5 GatedDeltaNet layers: tape-replay rollback
        self.layers: list = self._inner.layers
        self.embed_tokens = self._inner.embed_tokens
        self._store: List[Optional[mx.array]] = []
        self.tap_ids: List[int] = []
        self.passes = compiled.CompiledPasses(self)
        self._windows: Optional[List[Optional[int]]] = None
        # draft trees need one RoPE position per token (engine/ops/rope.py); recurrent layers cannot
        # branch; a tree's mask has no sliding window
        self.trees = (
            not self.hybrid
            and type(self._outer).__module__ not in NO_TREES
            and self._full_attention()
            and rope.wrap_ropes(self.layers)
        )
        if tap_ids:
            self.set_taps(tap_ids)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        w = self.embed_tokens.weight
        dims = w.shape[1]
        if hasattr(self.embed_tokens, "bits"):  # quantized: packed uint32 columns
            dims = dims * 32 // self.embed_tokens.bits
        return dims

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    @property
    def quantized(self) -> bool:
        """Whether any layer runs a quantized matmul (mlx-lm's ``quantization``: every mode)."""
        return any(hasattr(m, "bits") for _, m in self.model.named_modules())

    def set_taps(self, tap_ids: Sequence[int]) -> None:
        bad = [i for i in tap_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"tap layer {bad[0]} does not exist: the target has {self.num_layers} layers"
            )
        for i, layer in enumerate(self.layers):  # undo an earlier set of taps
            if isinstance(layer, _Tap):
                self.layers[i] = layer.layer
        self.tap_ids = list(tap_ids)
        self._store[:] = [None] * len(self.tap_ids)
        for slot, i in enumerate(self.tap_ids):
            self.layers[i] = _Tap(self.layers[i], self._store, slot)

    def make_cache(self, lengths: Optional[Lengths] = None, capacity: int = 0) -> list:
        """Per-layer caches for a batch whose rows hold ``lengths`` tokens: ``RaggedKVCache`` for
        attention layers (``capacity`` key positions allocated at first use), ``TapeCache`` for
        GatedDeltaNet layers (see engine/ops/batch_cache.py). None: one empty row, for a single pass
        (the caller advances ``lengths`` otherwise)."""
        lengths = Lengths([0]) if lengths is None else lengths
        caches = hybrid.make_cache(self.model) if self.hybrid else make_prompt_cache(self.model)
        out = []
        for i, c in enumerate(caches):
            if type(c) is KVCache:
                out.append(RaggedKVCache(lengths, capacity))
            elif (
                type(c) is RotatingKVCache and c.keep == 0
            ):  # a sliding window: every key kept, masked
                out.append(RaggedKVCache(lengths, capacity, window=c.max_size))
            elif isinstance(c, hybrid.TapeCache):
                out.append(c)
            else:
                raise TypeError(
                    f"layer {i} uses {type(c).__name__}; this engine decodes targets whose layers use "
                    "full attention (KVCache), a sliding window (RotatingKVCache without kept "
                    "positions) or GatedDeltaNet (qwen3_5), not quantized or other caches"
                )
        return out

    def _full_attention(self) -> bool:
        """Whether every layer attends to all earlier keys (False too for caches ``check_cache``
        refuses: that error comes when the engine loads)."""
        try:
            return not any(self.windows())
        except TypeError:
            return False

    def windows(self) -> List[Optional[int]]:
        """Each cache layer's sliding window (None: full attention or recurrent), as ``make_cache``
        gives them."""
        if self._windows is None:
            self._windows = [getattr(c, "window", None) for c in self.make_cache(Lengths([0]))]
        return self._windows

    def check_cache(self) -> None:
        """Refuse, before any decoding, a target whose caches this engine cannot batch or roll back."""
        self.make_cache(Lengths([0]))

    def rollback(self, cache: list, keep: Sequence[int]) -> None:
        """After a verify pass, keep the first ``keep[b]`` of its rows in batch row b. Attention
        layers need nothing (the caller advances the shared lengths); recurrent layers replay."""
        for c in cache:
            if isinstance(c, hybrid.TapeCache):
                c.trim_rows(keep)

    def reorder(self, cache: list, order: mx.array) -> None:
        """After a draft tree's pass: each row's accepted path moves to the front of its columns
        (``RaggedKVCache.reorder``; trees are verified on attention-only targets)."""
        for c in cache:
            c.reorder(order)

    def embed(self, tokens: mx.array) -> mx.array:
        """The token embeddings the first layer sees (the drafter's input): gemma4_text scales
        them inside its forward, where Hugging Face's scaled embedding module does it."""
        h = self.embed_tokens(tokens)
        scale = getattr(self._inner, "embed_scale", None)
        return h if scale is None else h * scale

    def lm_head(self, h: mx.array) -> mx.array:
        head = getattr(self._outer, "lm_head", None)
        if head is not None:
            return head(h)
        return self.embed_tokens.as_linear(h)

    def head_rows(self, ids: mx.array):
        """``lm_head`` cut to the vocabulary rows ``ids``: h [..., H] -> logits [..., len(ids)],
        equal to ``lm_head(h)[..., ids]``. The rows are copied once (quantized heads stay
        quantized: a row's groups run along the hidden axis); a head of another kind is run whole
        and its columns taken."""
        head = getattr(self._outer, "lm_head", None)
        tied = head is None
        head = self.embed_tokens if tied else head
        if isinstance(head, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w, scales, biases = head["weight"][ids], head["scales"][ids], head.get("biases")
            biases = None if biases is None else biases[ids]
            bias = None if tied or "bias" not in head else head["bias"][ids]
            mx.eval(w, scales, biases, bias)
            kw = dict(transpose=True, group_size=head.group_size, bits=head.bits, mode=head.mode)

            def quantized(h):
                out = mx.quantized_matmul(h, w, scales=scales, biases=biases, **kw)
                return out if bias is None else out + bias

            return quantized
        if type(head) in (nn.Linear, nn.Embedding, matmul.RoutedLinear):
            w = head["weight"][ids]
            bias = None if tied or "bias" not in head else head["bias"][ids]
            mx.eval(w, bias)
            return lambda h: matmul.linear(h, w, bias)
        return lambda h: self.lm_head(h)[..., ids]

    def decode_pass(self, tokens: mx.array, cache: list) -> Tuple[mx.array, Optional[mx.array]]:
        """A decoding cycle's verify pass: ``verify``, replayed from a trace where it can be
        (engine/ops/compiled.py)."""
        return self.passes(tokens, cache)

    def verify(
        self, tokens: mx.array, cache: list, at: Optional[mx.array] = None
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """A pass that ``rollback`` may cut short: recurrent layers record a tape for it."""
        if self.hybrid:
            hybrid.arm(cache)
        return self(tokens, cache, at)

    def __call__(
        self, tokens: mx.array, cache: list, at: Optional[mx.array] = None
    ) -> Tuple[mx.array, Optional[mx.array]]:
        """logits [B, L, V] and the tapped hidden states concatenated on the last axis. With ``at``
        (int [B]) only row b's logits at position at[b], [B, 1, V]: a prefill pass needs just its
        last ones, and the LM head over every position costs memory (B x L x V) and about a tenth of
        a 4B model's compute, for logits thrown away."""
        if at is None:
            logits = self.model(tokens, cache=cache)
        elif self.head_after_backbone:
            h = self._inner(tokens, cache)
            logits = self.lm_head(h[mx.arange(h.shape[0]), at][:, None, :])
        else:
            logits = self.model(tokens, cache=cache)[mx.arange(tokens.shape[0]), at][:, None, :]
        if not self.tap_ids:
            return logits, None
        hidden = mx.concatenate(self._store, axis=-1)
        self._store[:] = [None] * len(self.tap_ids)
        return logits, hidden
