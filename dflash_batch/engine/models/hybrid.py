"""Hybrid targets (mlx-lm ``qwen3_5`` / ``qwen3_5_moe``): GatedDeltaNet layers that roll back.

A recurrent state cannot be trimmed like a KV cache. Instead, a verify pass records a tape, and
rollback replays the accepted prefix of it from the state saved before the pass:

    arm:      mark the caches; the next pass records
    verify:   run the T rows; keep S_0 by reference (MLX arrays are immutable: no copy), and per
              step delta_t = beta_t (v_t - g_t S_{t-1} k_t), k_t, g_t, and the conv input
              concat(conv state, qkv rows)
    rollback: keep n rows: S_n = replay(delta_1..n, k_1..n, g_1..n from S_0)
              conv state = conv input rows [n, n + K - 1)

No projection is re-run and no state is copied. Only armed passes record; prefill and plain
decoding run mlx-lm's own layer, except on CUDA where the recurrence always runs the fused
kernel (mlx-lm runs it there as a Python loop over the tokens), without a tape when unarmed.
The Metal and CUDA kernels check themselves against the reference before first use and give way
to it on a failure (``kernels/selfcheck.py``).

``attach(model)`` changes the class of each qwen3_5 GatedDeltaNet instance to ``TapeGatedDeltaNet``
(a subclass; the parameter tree and weights are untouched; nothing class-wide is patched).
``make_cache(model)`` gives ``TapeCache`` (an ``ArraysCache``) for those layers.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from ..ops.kernels import gated_delta


class TapeCache(ArraysCache):
    """``cache[0]`` conv state [B, K-1, conv_dim], ``cache[1]`` recurrent state [B, Hv, Dv, Dk],
    plus, after an armed pass, that pass's tape and the recurrent state it started from."""

    def __init__(self):
        super().__init__(size=2)
        self.armed = False
        self.tape = None  # (recurrent state before, delta, k, g, conv input) of the armed pass

    def arm(self) -> None:
        self.armed, self.tape = True, None

    def record(
        self, state: mx.array, delta: mx.array, k: mx.array, g: mx.array, conv_input: mx.array
    ) -> None:
        """Keep (by reference: MLX arrays are immutable) what ``trim`` needs to replay."""
        self.tape = (state, delta, k, g, conv_input)

    def disarm(self) -> None:
        self.armed, self.tape = False, None

    def is_trimmable(self) -> bool:
        return True  # right after an armed pass, which is the only time rollback happens

    def trim(self, n: int) -> int:
        """Drop the last ``n`` rows of the armed pass in every batch row."""
        if n:
            delta = self._tape()[1]
            self.trim_rows([delta.shape[1] - n] * delta.shape[0])
        self.disarm()
        return n

    def trim_rows(self, keep) -> None:
        """Keep the first ``keep[b]`` steps of the armed pass in batch row b; replay from the saved state.

        Steps past a row's keep replay as the identity (g = 1, delta = 0: S' = 1 * S + 0 k^T = S,
        exactly, and rounding an already stored value changes nothing), so one replay of the
        longest keep serves every row, and each row ends exactly where its own replay would.
        """
        state, delta, k, g, conv_input = self._tape()
        B, T = delta.shape[:2]
        if len(keep) != B or not all(0 <= n <= T for n in keep):
            raise ValueError(f"cannot keep {list(keep)} steps of a pass of {T} in {B} rows")
        width = conv_input.shape[1] - T  # K - 1 rows of conv state, then the pass's T rows
        if all(n == T for n in keep):
            self.disarm()
            return
        steps = max(keep)
        if len(set(keep)) == 1:
            # the last K-1 kept inputs
            self[0] = mx.contiguous(conv_input[:, steps : steps + width, :])
            self[1] = gated_delta.replay(delta[:, :steps], k[:, :steps], g[:, :steps], state)
        else:
            n = mx.array(list(keep), dtype=mx.int32)[:, None]
            kept = mx.arange(steps, dtype=mx.int32)[None] < n  # [B, steps]
            # conv inputs keep_b .. keep_b+K-2
            rows = (n + mx.arange(width, dtype=mx.int32)[None])[..., None]
            self[0] = mx.take_along_axis(conv_input, rows, axis=1)
            g_kept = mx.where(kept[..., None], g[:, :steps], mx.array(1, g.dtype))
            d_kept = mx.where(kept[..., None, None], delta[:, :steps], mx.array(0, delta.dtype))
            self[1] = gated_delta.replay(d_kept, k[:, :steps], g_kept, state)
        self.disarm()

    def _tape(self):
        if self.tape is None:
            raise RuntimeError(
                "this GatedDeltaNet cache recorded no tape: verify with Target.verify()"
            )
        return self.tape

    # -- rows of a batch (engine/batch.py) ----------------------------------------------------
    def row_state(self, b: int, n: int = 0) -> Optional[list]:
        """A copy of batch row b's (conv state, recurrent state); None if the layer has run no pass."""
        if self[0] is None:
            return None
        return [mx.contiguous(c[b : b + 1]) for c in self.cache]

    def put_row(self, b: int, state: Optional[list], batch_size: int) -> None:
        """Copy a row state (``row_state``: a prefilled prompt) into batch row ``b``."""
        if state is None:
            return
        for i in (0, 1):
            value = state[i]
            if self[i] is None:
                self[i] = mx.zeros((batch_size,) + value.shape[1:], value.dtype)
            self[i][b : b + 1] = value

    def add_rows(self, states, have: int) -> None:
        """Append one row per state (``row_state``, or None: a fresh row, zero state as a first
        pass starts from) after the ``have`` rows held."""
        present = [s for s in states if s is not None]
        if self[0] is None and not present:
            return  # every row fresh: the next pass starts them all from zeros
        like = self.cache if self[0] is not None else present[0]
        for i in (0, 1):
            zero = mx.zeros((1,) + like[i].shape[1:], like[i].dtype)
            old = (
                self[i]
                if self[i] is not None
                else mx.zeros((have,) + like[i].shape[1:], like[i].dtype)
            )
            self[i] = mx.concatenate([old] + [zero if s is None else s[i] for s in states], axis=0)

    def take_rows(self, rows: mx.array) -> None:
        self.cache = [None if c is None else c[rows] for c in self.cache]

    def arrays(self) -> list:
        return [c for c in self.cache if c is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)


class TapeGatedDeltaNet(qwen3_5.GatedDeltaNet):
    """mlx-lm's qwen3_5 GatedDeltaNet, recording a tape when its cache is armed."""

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        armed = isinstance(cache, TapeCache) and cache.armed
        own = armed or gated_delta.backend() == "cuda"
        batched = cache is not None and (
            cache.lengths is not None or cache.left_padding is not None
        )
        if not own or mask is not None or batched or self.sharding_group is not None:
            if armed:
                raise RuntimeError("tape recording supports one unpadded, unsharded sequence")
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)

        width = self.conv_kernel_size - 1
        conv_state = cache[0] if cache is not None and cache[0] is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, width, self.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)  # [B, K-1+S, conv_dim]
        if cache is not None:
            cache[0] = mx.contiguous(conv_input[:, -width:, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, heads, dim)
            for t, heads, dim in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        beta = mx.sigmoid(b)
        g = compute_g(self.A_log, a, self.dt_bias)  # exp(-exp(A_log) softplus(a + dt_bias))

        start = cache[1] if cache is not None else None
        if start is None:
            start = mx.zeros(
                (B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32
            )
        y, state, delta = gated_delta.recurrence(q, k, v, g, beta, start, record=armed)
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        if armed:
            cache.record(start, delta, k, g, conv_input)
        out = self.norm(y, z)
        return self.out_proj(out.reshape(B, S, -1))


def _gdn_layers(model: nn.Module) -> list:
    layers = getattr(model, "layers", None) or []
    return [
        getattr(layer, "linear_attn", None)
        for layer in layers
        if getattr(layer, "is_linear", False)
    ]


def attach(model: nn.Module) -> int:
    """Give each qwen3_5 GatedDeltaNet of ``model`` the tape path. Returns how many there are."""
    count = 0
    for gdn in _gdn_layers(model):
        if isinstance(gdn, qwen3_5.GatedDeltaNet):
            gdn.__class__ = TapeGatedDeltaNet
            count += 1
    return count


def make_cache(model: nn.Module) -> list:
    """mlx-lm's cache for ``model`` with a ``TapeCache`` for every attached GatedDeltaNet layer."""
    cache = make_prompt_cache(model)
    layers = model.layers
    for i, c in enumerate(cache):
        if type(c) is ArraysCache and isinstance(
            getattr(layers[i], "linear_attn", None), TapeGatedDeltaNet
        ):
            cache[i] = TapeCache()
    return cache


def arm(cache: list) -> None:
    """Make the next pass over ``cache`` record a tape in every GatedDeltaNet layer."""
    for c in cache:
        if isinstance(c, TapeCache):
            c.arm()
