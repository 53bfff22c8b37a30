"""Sampling controls, grammar masks and logprobs on the target's logits [B, T, V].

A verify pass scores positions n_b .. n_b + T - 1 of row b; position i continues the row's
committed tokens followed by the drafts d_b1..d_bi. Every control here is a function of that
prefix alone (penalties count its tokens, the grammar mask is the grammar state after it), so
position i gets exactly the distribution plain decoding would use after the same prefix. The
token chosen there (engine/decode.py: choose) is kept only when the drafts before it were kept,
that is when that prefix is the row's real output: every emitted token is drawn exactly as plain
sampling with the same controls draws it (docs/sampling.md).

Order, as in vLLM: penalties (on the raw logits), grammar mask, temperature, then top-k, top-p
and min-p on the tempered distribution; the Gumbel-max draw samples what is left, renormalized.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..request import SamplingControls

NEG_INF = float("-inf")


OFF = SamplingControls()  # every control at its default: what a free slot's row uses
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
FILTERS = ("top_k", "top_p", "min_p")


def penalized(request) -> bool:
    c = request.controls
    return any(getattr(c, name) != getattr(OFF, name) for name in PENALTIES)


def filtered(request) -> bool:
    c = request.controls
    return request.temperature > 0 and any(
        getattr(c, name) != getattr(OFF, name) for name in FILTERS
    )


def process(
    logits: mx.array,
    requests: Sequence,
    histories: Sequence[List[int]],
    drafted: Optional[mx.array],
    allowed: Optional[mx.array],
) -> mx.array:
    """The logits each row samples from [B, T, V] (fp32 where a control applies, else the logits as
    they are); ``requests[b]`` None for a free slot.

    ``histories[b]``: row b's committed output tokens; ``drafted`` [B, T - 1]: the drafts verified
    after them (None when T = 1); ``allowed`` [B, T, words] uint32: the grammar masks, packed 32
    tokens a word (engine/grammar.py: ``Grammars.masks``; None: no grammar).
    """
    live = [r for r in requests if r is not None]
    if allowed is None and not any(penalized(r) or filtered(r) for r in live):
        return logits
    out = logits
    if any(penalized(r) for r in live):
        out = _penalize(out.astype(mx.float32), requests, histories, drafted)
    out = masked(out, allowed) if allowed is not None else out.astype(mx.float32)
    if any(filtered(r) for r in live):
        out = _filter(out, requests)
    return out


BIT = mx.arange(32, dtype=mx.uint32)


@mx.compile
def masked(logits: mx.array, words: mx.array) -> mx.array:
    """fp32 logits [B, T, V] with -inf where bit v % 32 of ``words`` [B, T, W] word v // 32 is
    clear (32 W >= V). Compiled: the shifts, the cast and the select fuse into one pass over the
    logits, no [B, T, V] mask or gather in memory (on the CPU many times faster than unpacking
    the bits to a bool mask, then where: docs/results/engine-floors.md)."""
    B, T, V = logits.shape
    bits = (words[..., None] >> BIT) & 1  # [B, T, W, 32]: token 32 w + j's bit
    allowed = bits.reshape(B, T, -1)[..., :V] == 1
    return mx.where(allowed, logits.astype(mx.float32), NEG_INF)


def _penalize(logits: mx.array, requests, histories, drafted) -> mx.array:
    """Repetition penalty r over tokens in the prompt or output (logit / r if positive, * r if
    not: HF / vLLM); presence p and frequency f over output tokens (OpenAI):
        logit -= p * [count > 0] + f * count
    with counts over the committed output plus the drafts before each position."""
    B, T, V = logits.shape
    # output counts of the committed prefix and the prompt's tokens, scattered from sparse lists
    rows, tokens, numbers, prompt_rows, prompt_tokens = [], [], [], [], []
    for b, r in enumerate(requests):
        if r is None or not penalized(r):
            continue
        ids, n = np.unique(np.asarray(histories[b], np.int64), return_counts=True)
        rows += [b] * len(ids)
        tokens += ids.tolist()
        numbers += n.tolist()
        if r.controls.repetition_penalty != OFF.repetition_penalty:
            unique = np.unique(np.asarray(r.ids, np.int64)).tolist()
            prompt_rows += [b] * len(unique)
            prompt_tokens += unique
    counts = _scatter(B, V, rows, tokens, numbers)[:, None, :]
    seen_prompt = _scatter(B, V, prompt_rows, prompt_tokens, [1.0] * len(prompt_tokens)) > 0
    if drafted is not None and drafted.shape[1] > 0:
        # position i also counts drafts d_1..d_i: a running sum of one-hot rows, shifted by one
        onehot = (drafted[..., None] == mx.arange(V, dtype=drafted.dtype)).astype(mx.float32)
        running = mx.cumsum(onehot, axis=1)
        counts = counts + mx.concatenate([mx.zeros((B, 1, V), mx.float32), running], axis=1)
    counts = mx.broadcast_to(counts, (B, T, V))

    def per_row(name):
        return mx.array(
            [getattr(r.controls if r is not None else OFF, name) for r in requests], mx.float32
        )[:, None, None]

    rep = per_row("repetition_penalty")
    seen = (counts > 0) | seen_prompt[:, None, :]
    out = mx.where(seen, mx.where(logits > 0, logits / rep, logits * rep), logits)
    return out - per_row("presence_penalty") * (counts > 0) - per_row("frequency_penalty") * counts


def _scatter(B: int, V: int, rows: List[int], tokens: List[int], values: List[float]) -> mx.array:
    """A [B, V] float32 array, zero but for values[i] at (rows[i], tokens[i])."""
    out = mx.zeros((B, V), mx.float32)
    if not rows:
        return out
    return out.at[mx.array(rows, mx.int32), mx.array(tokens, mx.int32)].add(
        mx.array(values, mx.float32)
    )


def _filter(logits: mx.array, requests) -> mx.array:
    """Top-k, then top-p of what top-k kept (renormalized), then min-p, on logits / temperature:
    together one threshold per position; a token is kept if its logit reaches it (ties at the
    threshold all kept). Greedy rows and rows without filters keep everything."""
    B, T, V = logits.shape

    def per_row(fn):
        return mx.array(
            [fn(r) if r is not None and filtered(r) else fn(None) for r in requests], mx.float32
        )[:, None, None]

    scale = per_row(lambda r: 1.0 / r.temperature if r else 1.0)
    k = per_row(lambda r: (r.controls.top_k or V) if r else V)
    p = per_row(lambda r: r.controls.top_p if r else 1.0)
    log_min_p = per_row(
        lambda r: math.log(r.controls.min_p) if r and r.controls.min_p > 0 else NEG_INF
    )
    scaled = logits * scale
    ordered = mx.sort(scaled, axis=-1)[..., ::-1]  # descending
    rank = mx.arange(V, dtype=mx.float32)
    in_k = rank < k
    probs = mx.softmax(mx.where(in_k, ordered, NEG_INF), axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    # nucleus: the best tokens until their mass reaches p (the first always kept)
    kept = mx.maximum(mx.sum(in_k & (before < p), axis=-1, keepdims=True), 1)
    threshold = mx.take_along_axis(ordered, (kept - 1).astype(mx.int32), axis=-1)
    threshold = mx.maximum(threshold, ordered[..., :1] + log_min_p)  # p >= min_p * p_max
    keep = (scaled >= threshold) | (scale == 0)
    return mx.where(keep, logits, NEG_INF)


def logprobs(logits: mx.array, chosen: mx.array, top: int):
    """Raw log-probabilities (log_softmax of the target's logits, before any control): of the
    chosen tokens [B, T], and the ``top`` best alternatives, ids and values [B, T, top]."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    picked = mx.take_along_axis(lp, chosen[..., None].astype(mx.int32), axis=-1)[..., 0]
    if top <= 0:
        return picked, None, None
    best = mx.argpartition(-lp, kth=top - 1, axis=-1)[..., :top]  # the top k, unordered
    values = mx.take_along_axis(lp, best, axis=-1)
    order = mx.argsort(-values, axis=-1)  # best first
    return (
        picked,
        mx.take_along_axis(best, order, axis=-1),
        mx.take_along_axis(values, order, axis=-1),
    )
