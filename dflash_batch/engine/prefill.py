"""Prompts joining a batch: packed prefill, and prefixes prefilled once and shared.

**Packed prefill.** The prompts joining the batch (``JoinGroup``, one row each) are prefilled
together, one ragged target pass per chunk. In a pass row j brings its next c_j prompt tokens,
padded to C = max_j c_j, where c_j = min(r_j, C), r_j is what row j has left up to its next mark
(at most ``width``) and C = max(min_j r_j, width / 4): rows advance together, and a row that has
less left pads less than a quarter of the width:

    attention:  row j's keys are written at columns n_j .. n_j + C - 1 and query i of row j sees
                keys j' <= n_j + i (engine/ops/batch_cache.py), so row j's padding comes after all of
                its valid queries and lies past n_j + c_j, where its next pass overwrites it
    recurrent:  when the c_j differ the pass records its tape and row j keeps its first c_j steps
                (``TapeCache.trim_rows``, as after a verify pass): no row absorbs padding
    drafter:    row j keeps its first c_j tapped hidden rows (the drafter's context, not yet
                written: the batch writes it when it first drafts for the row)
    lengths:    n_j += c_j

A row whose prompt is complete leaves the group with its state (``Prefix``) and its logits at
c_j - 1, from which the batch copies it into its slot and chooses its first token.

**What a pass costs.** Every decoding row waits while a pass runs, and a pass costs a fixed part
(reading the weights, launching its work) and a part per token (rows x C, padding included):
``PrefillCost`` fits seconds = fixed + per_token * tokens to the passes the engine timed. Rows that
leave the batch a few cycles apart would each pay the fixed part in a pass of their own; the batch
weighs that against leaving the free slots empty until the next row ends (engine/batch.py:
``_gather``).

**Shared prefixes.** ``share_marks`` finds, before a run, the prefixes its prompts share (the
longest common prefix with a neighbour in sorted order, cut to a multiple of ``granularity``
tokens; the whole prompt where two prompts are the same, as the n samples of one prompt are).
The first row to reach such a mark leaves its state there in the ``PrefixCache`` (keyed by the
token ids, least recently used dropped beyond a byte bound): attention keys 0..P-1, recurrent
states, the tapped rows that are the drafter's context, and the logits after the P-th token. A
later prompt starting with those ids copies that state and prefills only the rest; a whole
prompt found there needs no pass at all. The state after P tokens is the state the prompt alone
reaches after them, so the results are those of prefilling each prompt alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .ops.batch_cache import Lengths


@dataclass
class Prefix:
    """One row's state after its first ``length`` prompt tokens (per-layer ``row_state``s)."""

    length: int
    target: list
    # [1, length, taps*H]: the tapped rows of those tokens, the drafter's context, kept rather
    # than written into its cache: a row the batch never drafts for never pays for them (None:
    # no drafter)
    hidden: Optional[mx.array]
    logits: mx.array  # [1, 1, V] after token ``length``: the next token's distribution
    context: Optional[mx.array]  # [1, 0, taps*H]: width and dtype of tapped context rows

    def arrays(self) -> List[mx.array]:
        out = [self.logits] + ([] if self.hidden is None else [self.hidden])
        for state in self.target:
            out += [] if state is None else list(state)
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class PrefixCache:
    """Prefix states keyed by their token ids; the least recently used go beyond ``limit`` bytes."""

    def __init__(self, limit: int, granularity: int = 64):
        if granularity < 1:
            raise ValueError(f"prefix granularity must be at least 1, got {granularity}")
        self.limit, self.granularity = int(limit), granularity
        self.entries: "OrderedDict[Tuple[int, ...], Prefix]" = OrderedDict()
        self.bytes = 0

    def longest(self, ids: Sequence[int]) -> Optional[Prefix]:
        """The longest kept prefix of ``ids``: the whole prompt, else a multiple of the granularity."""
        g = self.granularity
        for n in [len(ids)] + list(range((len(ids) - 1) // g * g, 0, -g)):
            entry = self.entries.get(tuple(ids[:n]))
            if entry is not None:
                self.entries.move_to_end(tuple(ids[:n]))
                return entry
        return None

    def __contains__(self, key: Tuple[int, ...]) -> bool:
        return key in self.entries

    def put(self, key: Tuple[int, ...], prefix: Prefix) -> None:
        size = prefix.nbytes
        if key in self.entries or size > self.limit:
            return
        self.entries[key] = prefix
        self.bytes += size
        while self.bytes > self.limit:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0


def share_marks(prompts: Sequence[Sequence[int]], granularity: int) -> List[List[int]]:
    """Per prompt, the prefix lengths at which to keep its state for the others (ascending).

    In sorted order a prompt's longest common prefix with any other is the one with a neighbour;
    each neighbour pair names their common prefix cut to a multiple of ``granularity``, or the
    whole prompt where the two are the same. Every prompt that starts with a named prefix marks
    its length (a mark equal to a prompt's length is the whole prompt)."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    shared = set()
    for a, b in zip(order, order[1:]):
        p, q = prompts[a], prompts[b]
        common = _common_prefix(p, q)
        mark = common if common == len(p) == len(q) else common // granularity * granularity
        if mark:
            shared.add(tuple(p[:mark]))
    marks = []
    for ids in prompts:
        lengths = list(range(granularity, len(ids), granularity)) + [len(ids)]
        marks.append([m for m in lengths if tuple(ids[:m]) in shared])
    return marks


def _common_prefix(p: Sequence[int], q: Sequence[int]) -> int:
    n = 0
    for x, y in zip(p, q):
        if x != y:
            break
        n += 1
    return n


@dataclass
class PrefillCost:
    """Seconds of a packed prefill pass, fixed + per_token * tokens (tokens: rows x C), fitted by
    least squares to the last ``window`` passes timed (``observe``), both parts at least 0. The
    engine keeps one from job to job: a job's first joins are priced by the jobs before it."""

    window: int = 32
    passes: List[Tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        self.passes.append((tokens, seconds))
        del self.passes[: -self.window]

    def fixed(self) -> Optional[float]:
        """The fixed part; None until passes of two sizes have been timed (nothing tells it apart
        from the part per token before). At most the cheapest pass: a pass slowed by other work
        or by compiling a new shape (a GPU's first pass of a size) could tilt the line to a
        fixed part no pass shows, and the batch would leave its slots empty for it."""
        n = len(self.passes)
        mean_x = sum(x for x, _ in self.passes) / max(n, 1)
        mean_y = sum(y for _, y in self.passes) / max(n, 1)
        sxx = sum((x - mean_x) ** 2 for x, _ in self.passes)
        if not sxx:
            return None
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in self.passes) / sxx, 0.0)
        return min(max(mean_y - slope * mean_x, 0.0), min(y for _, y in self.passes))


@dataclass
class Joiner:
    """A prompt being prefilled in row of a ``JoinGroup``, for slot ``slot`` of the batch."""

    row: object  # batch.Row
    slot: int
    ids: List[int]
    done: int  # prompt tokens in the group's cache
    marks: List[int] = field(default_factory=list)  # prefix lengths still to keep (ascending)
    # tapped rows of those tokens, in pieces [1, c, taps*H]
    hidden: List[mx.array] = field(default_factory=list)

    def piece_end(self, width: int) -> int:
        """Where this row's next piece ends: ``width`` tokens on, cut at its next mark."""
        end = min(self.done + width, len(self.ids))
        return min([end] + [m for m in self.marks if m > self.done])


class JoinGroup:
    """The joining prompts' rows: their own caches and lengths, prefilled one packed pass at a
    time. The drafter runs no pass here: each row keeps its tapped rows (``Joiner.hidden``)."""

    def __init__(
        self,
        target,
        drafter,
        prefixes: Optional[PrefixCache],
        cost: Optional[PrefillCost] = None,
    ):
        self.target, self.drafter, self.prefixes = target, drafter, prefixes
        # what its passes cost: the engine's, from job to job
        self.cost = cost if cost is not None else PrefillCost()
        self.joiners: List[Joiner] = []
        self.lengths = Lengths([])
        self.cache = target.make_cache(self.lengths)
        self.producing: Dict[
            Tuple[int, ...], Joiner
        ] = {}  # prefix ids -> the row that will keep them
        # passes run, prompt tokens and pad tokens in them, seconds they took (plain-data stats)
        self.counts = {"passes": 0, "tokens": 0, "padding": 0, "seconds": 0.0}

    def add(self, joiner: Joiner, start: Optional[Prefix]) -> None:
        """Give ``joiner`` a row, starting from ``start`` (a kept prefix of its prompt) or empty."""
        have = len(self.joiners)
        n = 0 if start is None else start.length
        for c, s in zip(self.cache, start.target if start else [None] * len(self.cache)):
            c.add_rows([s], have)
        self.lengths.set(self.lengths.host + [n])
        joiner.hidden = [start.hidden] if start is not None and start.hidden is not None else []
        joiner.done = n
        joiner.marks = [m for m in joiner.marks if m > n]
        for m in joiner.marks:
            key = tuple(joiner.ids[:m])
            if self.prefixes is not None and key not in self.prefixes:
                self.producing.setdefault(key, joiner)
        self.joiners.append(joiner)

    def pending(self) -> int:
        """Prompt tokens the joining rows have still to prefill."""
        return sum(len(j.ids) - j.done for j in self.joiners)

    def waits_for(self, ids: Sequence[int], have: int) -> bool:
        """Whether a row of the group is about to keep a longer prefix of ``ids`` than ``have``."""
        return any(len(key) > have and tuple(ids[: len(key)]) == key for key in self.producing)

    def prefill(self, width: int) -> List[Tuple[Joiner, Prefix]]:
        """One packed pass, at most ``width`` tokens per row; returns the rows whose prompt is
        complete, each with its state, and takes them out of the group."""
        started = time.perf_counter()
        js = self.joiners
        # The pass is C wide: as far as the row with least left goes (no padding), but at least a
        # quarter of ``width`` (a row with less pads less than that), so passes stay wide.
        room = [j.piece_end(width) - j.done for j in js]
        C = min(max(room), max(min(room), width // 4))
        pieces = [j.ids[j.done : j.done + min(r, C)] for j, r in zip(js, room)]
        counts = [len(p) for p in pieces]
        tokens = mx.array([p + [0] * (C - len(p)) for p in pieces], dtype=mx.int32)
        # logits after each row's last valid token: row j, column c_j - 1
        at = mx.array(counts, dtype=mx.int32) - 1
        if len(set(counts)) > 1:  # ragged: recurrent rows keep their own c_j steps (tape replay)
            last, hidden = self.target.verify(tokens, self.cache, at)
            self.target.rollback(self.cache, counts)
        else:
            last, hidden = self.target(tokens, self.cache, at)
        self.lengths.advance(counts)
        keep = self.drafter is not None and hidden is not None
        if keep:
            for b, (j, c) in enumerate(zip(js, counts)):
                j.hidden.append(hidden[b : b + 1, :c])
        mx.eval(last, [c.arrays() for c in self.cache], hidden if keep else [])
        self.counts["passes"] += 1
        self.counts["tokens"] += sum(counts)
        self.counts["padding"] += C * len(counts) - sum(counts)
        context = None if hidden is None else hidden[:1, :0]
        finished = []
        for b, (j, c) in enumerate(zip(js, counts)):
            j.done += c
            at_mark = j.marks and j.marks[0] == j.done
            if at_mark or j.done == len(j.ids):
                state = self.state(b, last[b : b + 1], context)
                if at_mark:
                    self.keep(j, state)
                if j.done == len(j.ids):
                    finished.append((b, j, state))
        self._remove([b for b, _, _ in finished])
        seconds = time.perf_counter() - started
        self.counts["seconds"] += seconds
        self.cost.observe(C * len(counts), seconds)
        return [(j, state) for _, j, state in finished]

    def state(self, b: int, logits: mx.array, context: Optional[mx.array]) -> Prefix:
        """Row b's state as it stands (a copy)."""
        n = self.lengths.host[b]
        j = self.joiners[b]
        hidden = None
        if (
            j.hidden
        ):  # one array of its own from here on: a piece (a slice) keeps its whole pass's rows alive
            hidden = (
                mx.contiguous(j.hidden[0])
                if len(j.hidden) == 1
                else mx.concatenate(j.hidden, axis=1)
            )
            j.hidden = [hidden]
        state = Prefix(n, [c.row_state(b, n) for c in self.cache], hidden, logits, context)
        mx.eval(state.arrays())
        return state

    def keep(self, j: Joiner, state: Prefix) -> None:
        key = tuple(j.ids[: j.done])
        j.marks.pop(0)
        if self.producing.get(key) is j:
            del self.producing[key]
        if self.prefixes is not None:
            self.prefixes.put(key, state)

    def _remove(self, rows: List[int]) -> None:
        if not rows:
            return
        for b in rows:
            for key in [k for k, j in self.producing.items() if j is self.joiners[b]]:
                del self.producing[key]
        keep = [b for b in range(len(self.joiners)) if b not in set(rows)]
        self.joiners = [self.joiners[b] for b in keep]
        if not keep:  # an empty group starts afresh (and lets go of its buffers)
            self.lengths.set([])
            self.cache = self.target.make_cache(self.lengths)
            return
        index = mx.array(keep, dtype=mx.int32)
        for c in self.cache:
            c.take_rows(index)
        self.lengths.set([self.lengths.host[b] for b in keep])
