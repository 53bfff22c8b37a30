"""Draft trees: one verify pass checks several continuations of each row's block.

The drafter scores every block position k = 1..P at once, q_k(x) (its positions are drafted in
parallel, so their marginals are all it gives). A chain verifies the top token of each position;
a tree of the same width verifies the continuations the drafter finds most likely:

    score(c_1 .. c_d) = log q_1(c_1) + ... + log q_d(c_d)
    tree              = the N best-scoring prefixes (best first; every log q <= 0, so a prefix
                        scores at least its extensions and the set is closed under prefixes)
    E[accepted]       = sum over nodes of P(the target writes that node's prefix)

which the best-first tree maximises where the drafter's marginals are calibrated. Node 0 is the
row's last committed token (depth 0); node i > 0 holds c_d at depth d, after its parent; the
chain of best children takes nodes 1..k (``fit``). An adaptive width policy picks N once the
prefixes are known (engine/widths.py: ``WidthPolicy.tree_width``).

The verify pass runs the T = N + 1 nodes of row b at positions n_b + depth (RoPE: ``TokenRoPE``),
each node seeing the row's committed keys, its ancestors and itself (``batch_cache.tree_visible``), and picks
t_i = the target's token after node i's prefix. Acceptance walks from the root along the child
whose token is t_i; the bonus is t at the last node reached. The walk's nodes then move to
columns n_b .. n_b + a_b of the K/V buffers (``order``, ``RaggedKVCache.reorder``), where a chain's would be. Every
committed token is still the target's own choice after its committed prefix: output is lossless.

A chain is the tree whose node i is the top token at depth i; with the same verify width a
tree commits more per cycle once the drafter is often wrong (docs/batched.md, "Draft trees",
with the default pair's figures and their command).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

CANDIDATES = 8  # top tokens per draft position a tree chooses among


@dataclass
class Trees:
    """One draft tree per row of a batch, all of T nodes."""

    tokens: List[List[int]]  # [B][T]: node 0 the row's last committed token
    parents: List[List[int]]  # [B][T]: node 0's is -1; a parent comes before its children
    depths: List[List[int]]  # [B][T]

    def device(self):
        """(tokens [B, T] int32, depth [B, T] int32, ancestors [B, T, T] bool: node i sees node j
        iff j is i or an ancestor of i)."""
        B, T = len(self.tokens), len(self.tokens[0])
        sees = np.zeros((B, T, T), dtype=bool)
        for b, parents in enumerate(self.parents):
            for i, p in enumerate(parents):
                sees[b, i, i] = True
                if p >= 0:
                    sees[b, i] |= sees[b, p]
        return (
            mx.array(self.tokens, dtype=mx.int32),
            mx.array(self.depths, dtype=mx.int32),
            mx.array(sees),
        )


@dataclass
class Prefixes:
    """One row's best-scoring prefixes, best first: node 0 the root (the row's last committed
    token), node i > 0 a prefix of score ``scores[i]`` = sum of log q_k along it. Any first n nodes
    are closed under prefixes (a prefix scores at least its extensions), so they are the best tree
    of n - 1 nodes."""

    tokens: List[int]
    parents: List[int]
    depths: List[int]
    scores: List[float]

    def verified(self, L: int) -> int:
        """Nodes, the root included, that a row allowed to commit L tokens verifies: its first
        L - 1 prefixes and the root."""
        return max(1, min(L, len(self.tokens)))


def drafts(drafter, target, mode: str) -> Optional[str]:
    """What a drafting cycle verifies, as the engine was loaded: "tree" (``mode`` says trees, and
    the target can verify them and the drafter does not select its own path) or "chain", None
    without a drafter."""
    if drafter is None:
        return None
    return mode if target.trees and not drafter.selects else "chain"


def best_first(
    last: Sequence[int], ids: np.ndarray, logprobs: np.ndarray, reach: Sequence[int]
) -> List[Prefixes]:
    """Each row's best-scoring prefixes under its root ``last[b]`` (module doc) over the candidates
    ``ids`` [B, P, C] (each position's best first) with their log-probabilities ``logprobs``
    [B, P, C]: ``reach[b]`` of them at most, none longer."""
    out = []
    for b, root in enumerate(last):
        row = Prefixes([int(root)], [-1], [0], [0.0])
        count, deepest = int(reach[b]), min(int(reach[b]), ids.shape[1])
        # best first over rank tuples r: a popped prefix offers its first child (r + (0,)) and its
        # next sibling (last rank + 1), so prefixes come out in order of score
        node_of = {(): 0}
        heap = [(-float(logprobs[b, 0, 0]), (0,))] if deepest > 0 else []
        while heap and len(row.tokens) <= count:
            neg, r = heapq.heappop(heap)
            d = len(r)
            node_of[r] = len(row.tokens)
            row.tokens.append(int(ids[b, d - 1, r[-1]]))
            row.parents.append(node_of[r[:-1]])
            row.depths.append(d)
            row.scores.append(-neg)
            if d < deepest:
                heapq.heappush(heap, (neg - float(logprobs[b, d, 0]), r + (0,)))
            if r[-1] + 1 < ids.shape[2]:
                sibling = (
                    neg + float(logprobs[b, d - 1, r[-1]]) - float(logprobs[b, d - 1, r[-1] + 1])
                )
                heapq.heappush(heap, (sibling, r[:-1] + (r[-1] + 1,)))
        out.append(row)
    return out


def fit(rows: Sequence[Prefixes], limits: Sequence[int], T: int) -> Trees:
    """The trees a pass of width T verifies: row b's first L_b - 1 prefixes (L_b = ``limits[b]``:
    what row b may commit, bonus included), padded to T nodes with copies of its first child
    (never walked: the walk takes the first matching child), else of the root."""
    trees = Trees([], [], [])
    for row, L in zip(rows, limits):
        n = row.verified(L)
        tokens, parents, depths = _chain_first(row.tokens[:n], row.parents[:n], row.depths[:n])
        first = 1 if n > 1 else 0
        pad = T - n
        trees.tokens.append(tokens + [tokens[first]] * pad)
        trees.parents.append(parents + [parents[first]] * pad)
        trees.depths.append(depths + [depths[first]] * pad)
    return trees


def _chain_first(tokens: List[int], parents: List[int], depths: List[int]):
    """The nodes re-indexed so that the chain of best children from the root (the drafter's top
    token at each depth, as far as the tree holds it) takes nodes 1..k: when the target accepts
    along it, as it mostly does, the path already sits where a chain's would (``order`` is the
    identity) and the cache needs no move. Parents still come before their children."""
    chain = [0]
    for i in range(1, len(tokens)):
        if parents[i] == chain[-1]:  # best first: a node's first child is its best
            chain.append(i)
    on = set(chain)
    new = chain + [i for i in range(len(tokens)) if i not in on]
    index = {old: k for k, old in enumerate(new)}
    return (
        [tokens[i] for i in new],
        [index[parents[i]] if parents[i] >= 0 else -1 for i in new],
        [depths[i] for i in new],
    )


def walk(trees: Trees, chosen: Sequence[Sequence[int]]) -> List[List[int]]:
    """Each row's accepted path, root first: from node i, on to the first child holding t_i."""
    paths = []
    for tokens, parents, t in zip(trees.tokens, trees.parents, chosen):
        path = [0]
        for i in range(1, len(tokens)):
            if parents[i] == path[-1] and tokens[i] == t[path[-1]]:
                path.append(i)
        paths.append(path)
    return paths


def order(paths: Sequence[Sequence[int]], T: int) -> List[List[int]]:
    """Per row, the node that each of columns n_b .. n_b + T - 1 takes after acceptance: the path
    first (so a row keeps columns n_b .. n_b + a_b, as after a chain), then the other nodes."""
    out = []
    for path in paths:
        on = set(path)
        out.append(list(path) + [i for i in range(T) if i not in on])
    return out
