"""Caches for a batch of sequences that each keep their own length (ragged acceptance).

Row b of a batch has committed ``lengths[b]`` tokens. Every layer's K/V buffer is
[B, Hk, capacity, D] and row b's valid keys are columns ``0 .. lengths[b]-1``; rows are never
shifted or copied per cycle:

    write:    a pass of T tokens writes row b's K/V at columns lengths[b] .. lengths[b]+T-1
    attend:   query i of row b sees key j  iff  j <= lengths[b] + i        (causal in the block)
    rollback: lengths[b] += keep[b]; the rejected columns stay, unseen, and are overwritten next

One ``Lengths`` is shared by every layer of a batch (the engine advances it once per cycle), so
a layer's cache only reads it. When all rows have one length (always at batch 1) the cache
behaves exactly as mlx-lm's ``KVCache``: slice writes, keys cut to the exact length, mask
"causal" or None; the routed verify attention then sees the same shapes as before.

Sliding-window layers (mlx-lm's ``RotatingKVCache``, a ring buffer that cannot be cut back
per row) get a ``RaggedKVCache`` with a ``window``: every key stays, so rollback is the same
length bookkeeping, and the mask hides what the ring would have dropped:

    attend (window w):  query i of row b sees key j  iff  lengths[b] + i - w < j <= lengths[b] + i

which is the mask mlx-lm's own decoding applies through its ring buffer. The cost: such a layer's
memory grows with the context like a full-attention layer's, not capped at w positions.

GatedDeltaNet layers keep their state per row already (no length axis); their per-row rollback
is ``hybrid.TapeCache.trim_rows``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .rope import TokenPositions

STEP = 256  # capacity and ragged key lengths grow in these steps (few distinct shapes per job)


def round_up(n: int, step: int = STEP) -> int:
    return -(-n // step) * step


class Lengths:
    """Committed tokens per row, on the host (for shapes and bookkeeping) and on the device."""

    def __init__(self, values: Sequence[int] = ()):
        self.set(values)

    def set(self, values: Sequence[int]) -> None:
        self.host: List[int] = [int(v) for v in values]
        self.device = mx.array(self.host, dtype=mx.int32)
        self.uniform = len(set(self.host)) <= 1
        self.max = max(self.host, default=0)
        self._columns: Optional[Tuple[int, mx.array]] = None  # (T, columns(T)) until the next set
        # a draft tree's pass (engine/tree.py): (depth [B, T], ancestors [B, T, T]) while it is built
        self.tree: Optional[Tuple[mx.array, mx.array]] = None

    def columns(self, T: int) -> mx.array:
        """[B, T] int32: row b's columns n_b .. n_b + T - 1 for a pass of T rows; built once per
        pass and shared by every layer (one graph node instead of one per layer)."""
        if self._columns is None or self._columns[0] != T:
            self._columns = (T, self.device[:, None] + mx.arange(T, dtype=mx.int32)[None])
        return self._columns[1]

    def advance(self, by: Sequence[int]) -> None:
        self.set([n + k for n, k in zip(self.host, by)])

    def __len__(self) -> int:
        return len(self.host)


class RaggedKVCache:
    """One attention layer's K/V for a batch whose rows have their own lengths (see module doc).

    Implements what mlx-lm's attention layers use: ``offset`` (RoPE positions: an int when the
    rows agree, else one per row), ``update_and_fetch`` and ``make_mask``.
    """

    def __init__(self, lengths: Lengths, capacity: int = 0, window: Optional[int] = None):
        self.lengths = lengths
        # key positions to allocate at once (the job's longest row): no growth copies
        self.capacity = capacity
        self.window = window  # a sliding-window layer's: each query sees its last ``window`` keys
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    # -- what mlx-lm's layers call ---------------------------------------------------------
    @property
    def offset(self):
        if self.lengths.tree is not None:  # one RoPE position per node: n_b + its depth
            return TokenPositions(self.lengths.device[:, None] + self.lengths.tree[0])
        return self.lengths.host[0] if self.lengths.uniform else self.lengths.device

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write a pass's T rows per row at that row's length; return the keys to attend over."""
        T = keys.shape[2]
        self.reserve(self.lengths.max + T, keys, values)
        if self.lengths.uniform:
            n = self.lengths.max
            self.keys[..., n : n + T, :] = keys
            self.values[..., n : n + T, :] = values
            return self.keys[..., : n + T, :], self.values[..., : n + T, :]
        return self.write_columns(self.lengths.columns(T), keys, values, T)

    def write_columns(self, columns: mx.array, keys: mx.array, values: mx.array, reach: int):
        """Scatter keys [B, H, T, D] to columns [B, T] per row, none of them ``reach`` or more
        past the longest row; return the columns up to there (rounded up to a STEP) of keys and
        values to attend over."""
        needed = self.lengths.max + reach
        self.reserve(needed, keys, values)
        self.keys = put_columns(self.keys, columns, keys)
        self.values = put_columns(self.values, columns, values)
        width = round_up(needed)  # capacity is a multiple of STEP, so this fits
        return self.keys[..., :width, :], self.values[..., :width, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        window = window_size or self.window
        if self.lengths.tree is not None:
            if window:
                raise ValueError(
                    "draft trees are verified on full-attention layers only (no sliding window)"
                )
            width = self.lengths.max + N if self.lengths.uniform else round_up(self.lengths.max + N)
            return tree_visible(self.lengths.device, self.lengths.tree[1], width)
        if not self.lengths.uniform:  # bucketed key width (few distinct shapes), masked per row
            return visible(self.lengths.device, N, round_up(self.lengths.max + N), window=window)
        n = self.lengths.max
        if window and n + N > window:  # the window hides some key from the last query
            return create_causal_mask(N, n, window_size=window)
        if return_array:
            return _causal(N, n)
        return None if N == 1 else "causal"

    # -- capacity and rows ----------------------------------------------------------------------
    def reserve(self, columns: int, like_k: mx.array, like_v: mx.array) -> None:
        """Make room for ``columns`` key positions in every row: at first ``capacity`` at once,
        beyond it in STEP columns (a copy of the buffer each time, so for a moment twice its
        memory). ``like_k``/``like_v`` give heads, head dims and dtypes."""
        have = 0 if self.keys is None else self.keys.shape[2]
        if columns <= have:
            return
        B, (_, H, _, Dk) = len(self.lengths), like_k.shape
        grow = round_up(max(columns, self.capacity if self.keys is None else 0)) - have
        k_new = mx.zeros((B, H, grow, Dk), like_k.dtype)
        v_new = mx.zeros((B, H, grow, like_v.shape[3]), like_v.dtype)
        if self.keys is None:
            self.keys, self.values = k_new, v_new
        else:
            self.keys = mx.concatenate([self.keys, k_new], axis=2)
            self.values = mx.concatenate([self.values, v_new], axis=2)

    def row_state(self, b: int, n: int) -> Optional[tuple]:
        """A copy of row b's first ``n`` key columns (keys, values), each [1, H, n, D]; None if empty."""
        if self.keys is None or n == 0:
            return None
        return mx.contiguous(self.keys[b : b + 1, :, :n, :]), mx.contiguous(
            self.values[b : b + 1, :, :n, :]
        )

    def put_row(self, b: int, state: Optional[tuple], batch_size: int) -> None:
        """Place a row state (``row_state``: a prefilled prompt) in row ``b`` at columns 0..n-1."""
        if state is None:
            return  # nothing to copy: the caller sets the row's length to 0
        keys, values = state
        n = keys.shape[2]
        self.reserve(n, keys, values)
        self.keys[b : b + 1, :, :n, :] = keys
        self.values[b : b + 1, :, :n, :] = values

    def add_rows(self, states: Sequence[Optional[tuple]], have: int) -> None:
        """Append one row per state (``row_state``, or None: empty) after the ``have`` rows held;
        the caller then extends the shared lengths."""
        present = [s for s in states if s is not None]
        if self.keys is None and not present:
            return  # all rows empty: ``reserve`` allocates on the next write
        k_like, v_like = (self.keys, self.values) if self.keys is not None else present[0]
        width = max(
            [0 if self.keys is None else self.keys.shape[2]]
            + [round_up(s[0].shape[2]) for s in present]
        )
        old_k, old_v = self.keys, self.values
        if old_k is None:
            old_k = mx.zeros((have,) + k_like.shape[1:2] + (width, k_like.shape[3]), k_like.dtype)
            old_v = mx.zeros((have,) + v_like.shape[1:2] + (width, v_like.shape[3]), v_like.dtype)
        elif old_k.shape[2] < width:
            grow = width - old_k.shape[2]
            old_k = mx.concatenate(
                [old_k, mx.zeros(old_k.shape[:2] + (grow, old_k.shape[3]), old_k.dtype)], axis=2
            )
            old_v = mx.concatenate(
                [old_v, mx.zeros(old_v.shape[:2] + (grow, old_v.shape[3]), old_v.dtype)], axis=2
            )
        new_k = mx.zeros((len(states),) + old_k.shape[1:], old_k.dtype)
        new_v = mx.zeros((len(states),) + old_v.shape[1:], old_v.dtype)
        for i, s in enumerate(states):
            if s is not None:
                n = s[0].shape[2]
                new_k[i : i + 1, :, :n, :] = s[0]
                new_v[i : i + 1, :, :n, :] = s[1]
        self.keys = mx.concatenate([old_k, new_k], axis=0)
        self.values = mx.concatenate([old_v, new_v], axis=0)

    def reorder(self, order: mx.array) -> None:
        """After a tree pass: row b's column n_b + i takes what column n_b + order[b, i] holds,
        for i < W = order's width (engine/tree.py: the accepted paths move to the front). At one
        length, a slice write; else a scatter."""
        if self.keys is None:
            return
        W = order.shape[1]
        source = self.lengths.device[:, None] + order
        keys, values = _take_columns(self.keys, source), _take_columns(self.values, source)
        if self.lengths.uniform:
            n = self.lengths.max
            self.keys[..., n : n + W, :] = keys
            self.values[..., n : n + W, :] = values
        else:
            self.keys = put_columns(self.keys, self.lengths.columns(W), keys)
            self.values = put_columns(self.values, self.lengths.columns(W), values)

    def take_rows(self, rows: mx.array) -> None:
        """Keep only the given rows, in that order (the batch shrinks)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def arrays(self) -> list:
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- mlx-lm cache protocol bits the models may touch ------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None


def visible(
    lengths: mx.array, N: int, width: int, extra: int = 0, window: Optional[int] = None
) -> mx.array:
    """Bool mask [B, 1, N, width]: query i of row b sees key j iff j <= lengths[b] + extra + i
    (and, with a window, j > lengths[b] + extra + i - window)."""
    last = lengths[:, None, None, None] + extra + mx.arange(N, dtype=mx.int32)[None, None, :, None]
    key = mx.arange(width, dtype=mx.int32)[None, None, None, :]
    ok = key <= last
    return ok & (key > last - window) if window else ok


def tree_visible(lengths: mx.array, ancestors: mx.array, width: int) -> mx.array:
    """Bool mask [B, 1, T, width] of a tree pass: node i of row b sees the row's committed keys
    (j < lengths[b]) and, among the pass's columns lengths[b] + m, its ancestors and itself
    (ancestors [B, T, T])."""
    B, T, _ = ancestors.shape
    rel = mx.arange(width, dtype=mx.int32)[None] - lengths[:, None]  # [B, width]: m = j - n_b
    inside = (rel >= 0) & (rel < T)
    picked = mx.take_along_axis(
        ancestors, mx.broadcast_to(mx.clip(rel, 0, T - 1)[:, None, :], (B, T, width)), axis=2
    )
    return ((rel < 0)[:, None, :] | (inside[:, None, :] & picked))[:, None]


def _causal(N: int, offset: int) -> mx.array:
    return mx.arange(offset, offset + N)[:, None] >= mx.arange(offset + N)[None]


def _take_columns(buffer: mx.array, columns: mx.array) -> mx.array:
    """buffer[b, :, columns[b, t], :] as [B, H, T, D]."""
    B, H, _, D = buffer.shape
    index = mx.broadcast_to(columns[:, None, :, None], (B, H, columns.shape[1], D))
    return mx.take_along_axis(buffer, index, axis=2)


def put_columns(buffer: mx.array, columns: mx.array, rows: mx.array) -> mx.array:
    """buffer[b, :, columns[b, t], :] = rows[b, :, t, :] (a scatter along the key axis)."""
    B, H, T, D = rows.shape
    index = mx.broadcast_to(columns[:, None, :, None], (B, H, T, D))
    return mx.put_along_axis(buffer, index, rows, axis=2)
