"""The DFlash cycle for a batch of sequences, one short function per step.

Per cycle, for every row b of the batch, with ``last_b`` its newest committed token (not yet in the
target cache), n_b the tokens the cache holds, and T the cycle's verify width (the width policy's):

    draft:    d_b1..d_b(T-1) = argmax lm_head(drafter([last_b, MASK x (B-1)], new context rows of b))
    verify:   t_b0..t_b(T-1) = choose_b(target([last_b, d_b1..d_b(T-1)]))   (positions n_b.., one pass)
    accept:   a_b = longest prefix with d_b(i+1) == t_bi, at most L_b - 1   (L_b = min(T, budget_b))
              commit d_b1..d_ba, then the bonus t_ba
    rollback: row b keeps last_b, d_b1..d_ba (a_b + 1 rows): n_b += a_b + 1; the bonus becomes last_b
    context:  the a_b + 1 kept rows of tapped hidden state feed the next draft of row b

T = 1 is a plain decoding step (no draft: the target's choice is the bonus). Rows never see each
other: each row's keys are masked to its own length (engine/ops/batch_cache.py), recurrent layers
keep per-row state, and acceptance, rollback and budgets are per row. Every committed token is
the target's own choice given that row's committed prefix, so greedy output equals plain greedy
decoding of the target, row by row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .models.target import Target
from .ops.batch_cache import Lengths
from .ops.kernels import cpu


@dataclass
class Step:
    """Tokens one row committed in one target pass (its prefill, a verify cycle or a plain step)."""

    tokens: List[int]
    from_draft: int = 0  # leading tokens that were the drafter's proposals
    drafted: int = 0  # draft tokens put up for verification in this pass
    decoded: bool = False  # by a decoding cycle (a verify or a plain step), not the prefill
    logprobs: Optional[List[tuple]] = None  # per token: (logprob, [(id, logprob), ...]) when asked


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def choose(
    logits: mx.array, temperatures: Sequence[float], seeds: Sequence[int], first: mx.array
) -> mx.array:
    """Token ids [B, T] from logits [B, T, V]; position t of row b picks token number first[b] + t
    of that row's sequence (prompt included), or first[b, t] where ``first`` is [B, T] (a draft
    tree's nodes: engine/tree.py).

    Greedy rows (temperature 0): argmax. Sampling rows: the Gumbel-max draw
        argmax_v  logits[v] / temperature + g[v],   g ~ Gumbel(0, 1) drawn from the key (seed, position)
    which is a sample of softmax(logits / temperature). The noise of a position depends on the
    row's seed and that position alone, never on the cycle, the verify width or the other rows:
    a token is a function of its committed prefix and its own noise, exactly as in plain sampled
    decoding with the same keys. A draft token is kept only if it equals this sample, so every
    emitted token is distributed as the target's sample, and a seeded row reproduces its output.
    """
    greedy = mx.argmax(logits, axis=-1)
    if all(t <= 0 for t in temperatures):
        return greedy
    B, T, V = logits.shape
    # [B, T]
    positions = first if first.ndim == 2 else first[:, None] + mx.arange(T, dtype=mx.int32)[None]
    seed = mx.array([s & 0xFFFFFFFF for s in seeds], dtype=mx.uint32)[:, None]
    keys = mx.stack([mx.broadcast_to(seed, (B, T)), positions.astype(mx.uint32)], axis=-1).reshape(
        B * T, 2
    )
    noise = _gumbel(keys, V).reshape(B, T, V)
    scale = mx.array([1.0 / t if t > 0 else 0.0 for t in temperatures], dtype=mx.float32)[
        :, None, None
    ]
    sampled = mx.argmax(logits.astype(mx.float32) * scale + noise, axis=-1)
    is_greedy = mx.array([t <= 0 for t in temperatures])[:, None]
    return mx.where(is_greedy, greedy, sampled)


def _gumbel(keys: mx.array, vocab: int) -> mx.array:
    """Gumbel noise [N, vocab], row n drawn from keys[n]."""
    return mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)


def prefill(target: Target, prompt: List[int], cache: list, lengths: Lengths, chunk: int):
    """Run one prompt through a one-row cache in chunks; return its last logits and the tapped
    hidden state of every row."""
    hidden = []
    logits = None
    for i in range(0, len(prompt), chunk):
        piece = prompt[i : i + chunk]
        logits, h = target(mx.array([piece]), cache, at=mx.array([len(piece) - 1]))
        lengths.advance([len(piece)])
        if h is not None:
            hidden.append(h)
        mx.eval(logits, hidden[-1:])
    context = mx.concatenate(hidden, axis=1) if len(hidden) > 1 else (hidden[0] if hidden else None)
    return logits[:, -1:, :], context


class DraftHead:
    """Draft tokens from the target's LM head cut to a draft vocabulary V' (the tokens the target
    writes most, ``draft_vocab.json``):

        d = V'[argmax_j  lm_head(h)[V'_j]]

    A drafter proposes only what the verify pass can accept, and rare tokens are seldom guessed
    right, so a small V' costs little acceptance; the head's cost falls by |V| / |V'| (on a CPU
    the drafter's full head reads the whole vocabulary matrix for a handful of rows). Output is
    unchanged: the verify pass keeps the whole head."""

    def __init__(self, target: Target, vocab: Sequence[int]):
        self.ids = mx.array(list(vocab), dtype=mx.int32)
        self.logits = target.head_rows(self.ids)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __call__(self, h: mx.array) -> mx.array:
        return self.ids[mx.argmax(self.logits(h), axis=-1)]


def draft_block(
    drafter,
    target: Target,
    last: mx.array,
    context: mx.array,
    counts: Optional[mx.array],
    cache: list,
    rows: int,
    with_logits: bool = False,
    head: Optional[DraftHead] = None,
):
    """Propose ``rows`` tokens per row in one drafter pass: ids [B, rows] (position 0's output is unused);
    ``with_logits``: also the drafter's logits [B, rows, V] over the whole vocabulary (for rows that
    draft under a grammar); ``head``: draft from a draft vocabulary (``DraftHead``) instead.

    ``context`` [B, S] holds each row's new context rows, row b's first ``counts[b]`` valid (None:
    all S). The drafter always runs the whole block (compiled where it can be: engine/ops/compiled.py);
    only the LM head is cut to the rows verified.
    """
    h = _drafted_hidden(drafter, target, last, context, counts, cache, rows)
    # DFlash 2: one path through each position's top candidates (engine/models/dflash2.py)
    if drafter.selects:
        logits = target.lm_head(h)
        ids = drafter.propose(h, logits, last).astype(last.dtype)
        return (ids, logits) if with_logits else ids
    if head is not None and not with_logits:
        return head(h).astype(last.dtype)
    logits = target.lm_head(h)
    ids = mx.argmax(logits, axis=-1).astype(last.dtype)
    return (ids, logits) if with_logits else ids


def draft_candidates(
    drafter,
    target: Target,
    last: mx.array,
    context: mx.array,
    counts: Optional[mx.array],
    cache: list,
    rows: int,
    count: int,
    head: Optional[DraftHead] = None,
) -> Tuple[mx.array, mx.array]:
    """The ``count`` best tokens at each of ``rows`` draft positions, best first, ids [B, rows, count]
    and their log-probabilities under the drafter (over its draft vocabulary with ``head``): what
    a draft tree is grown from (engine/tree.py). One drafter pass, as ``draft_block``."""
    h = _drafted_hidden(drafter, target, last, context, counts, cache, rows)
    logits = (head.logits(h) if head is not None else target.lm_head(h)).astype(mx.float32)
    logprobs = logits - cpu.logsumexp(logits)
    count = min(count, logits.shape[-1])
    top = mx.argpartition(-logprobs, kth=count - 1, axis=-1)[..., :count]
    values = mx.take_along_axis(logprobs, top, axis=-1)
    best = mx.argsort(-values, axis=-1)
    top, values = mx.take_along_axis(top, best, axis=-1), mx.take_along_axis(values, best, axis=-1)
    ids = head.ids[top] if head is not None else top
    return ids.astype(last.dtype), values


def _drafted_hidden(
    drafter,
    target: Target,
    last: mx.array,
    context: mx.array,
    counts: Optional[mx.array],
    cache: list,
    rows: int,
) -> mx.array:
    """The drafter's output [B, rows, H] at draft positions 1..rows of the block [last, MASK x (B-1)]."""
    B = drafter.args.block_size
    block = mx.concatenate(
        [last, mx.full((last.shape[0], B - 1), drafter.args.mask_token_id, dtype=last.dtype)],
        axis=1,
    )
    return drafter.draft_pass(target.embed(block), context, cache, counts)[:, 1 : 1 + rows, :]


def accept_lengths(
    drafted: List[List[int]], chosen: List[List[int]], limits: Sequence[int]
) -> List[int]:
    """a_b = number of leading draft tokens of row b equal to the target's choice one position
    earlier, counting at most ``limits[b] - 1`` drafts (the row's own verify length)."""
    out = []
    for d, t, L in zip(drafted, chosen, limits):
        a = 0
        while a < L - 1 and d[a] == t[a]:
            a += 1
        out.append(a)
    return out


def gathers(pieces: Sequence[Tuple[mx.array, List[int]]]) -> bool:
    """Whether ``pack_context`` gathers these pieces' rows: some row is not full in some piece
    but the last (a drafting cycle's piece, whose rows kept fewer than it verified)."""
    return not all(min(c) == rows.shape[1] for rows, c in pieces[:-1])


def pack_context(
    pieces: Sequence[Tuple[mx.array, List[int]]],
) -> Tuple[Optional[mx.array], List[int]]:
    """Each row's pending context rows in one array, packed once, when the drafter runs: piece i
    is (rows [B, T_i, H], counts_i), row b's valid rows its first counts_i[b]. Row b of the result
    holds its valid rows of every piece in order, then padding (never read: the drafter is given
    the counts). Returns (rows [B, max_b sum_i counts_i[b], H], per-row counts); None for the rows
    where no row has any.

    Cycles append their pieces and only the drafting cycle packs them: repacking every cycle
    copies the backlog each time (quadratic over a run of plain cycles)."""
    if not pieces:
        return None, []
    counts = [sum(c) for c in zip(*(c for _, c in pieces))]
    width = max(counts)
    if width == 0:  # every row's pieces were dropped (its row left or a new one joined)
        return None, counts
    if not gathers(pieces):
        # every row full in every piece but the last: a plain concatenation keeps rows left-aligned
        both = (
            pieces[0][0]
            if len(pieces) == 1
            else mx.concatenate([rows for rows, _ in pieces], axis=1)
        )
        return both[:, :width], counts
    index = [[] for _ in counts]  # row b: the columns of its valid rows in the concatenation
    offset = 0
    for rows, c in pieces:
        for b, n in enumerate(c):
            index[b].extend(range(offset, offset + n))
        offset += rows.shape[1]
    index = mx.array([cols + [0] * (width - len(cols)) for cols in index], dtype=mx.int32)
    both = mx.concatenate([rows for rows, _ in pieces], axis=1)
    return mx.take_along_axis(both, index[..., None], axis=1), counts
