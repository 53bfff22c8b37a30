"""Continuous batching of DFlash decoding: rows join and leave between cycles.

``BatchDecoder.steps()`` repeats one engine step until every request is done:

    schedule:    admit waiting requests into free rows (chunked prefill, the joining prompts packed
                 into shared passes and shared prefixes reused: engine/prefill.py; per step, about
                 one chunk per free slot; free slots wait for a row about to end where a pass of
                 their own costs more: ``_gather``), then choose the cycle's verify width
                 (engine/widths.py)
    run:         one cycle over all rows: draft, verify, accept, roll back (engine/decode.py)
    postprocess: feed each row's committed tokens to its output (EOS, stop strings, budget);
                 finished rows free their slot at once

The requests come as a list or as a stream (engine/waiting.py: pulled as slots free up, a
small look-ahead encoded ahead). The batch holds ``slots`` rows of device state. A free slot's
row still rides along in the passes (its length is 0 and nothing is read from it) until a
waiting request takes it; once no request can come any more, the batch shrinks to its live rows
whenever a quarter of it is idle, where the rows dropped pay for any new shape's compile
(engine/widths.py, "What a new shape costs"). A stream's memory plan (engine/memory.py: ``Plan``) may lower
the rows in flight when a longer request arrives: then no request joins until the batch has
narrowed to that many rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ..completion import Piece
from ..errors import Cancelled, Requeued
from ..request import SamplingControls
from . import decode, memory, prefill, sampling, tree
from .decode import Step
from .ops import compiled
from .ops.batch_cache import Lengths, round_up
from .output import RowOutput
from .waiting import Waiting
from .widths import Acceptance, WidthPolicy, batch_rung, bucket

# Pending drafter context (prompts' tapped rows and plain cycles' pieces) is bounded: beyond this
# many packed prefill passes' worth of rows (``prefill_tokens`` each) it is written into the
# drafter's cache, drafting or not.
PENDING_PASSES = 16


@dataclass
class EncodedRequest:
    """One prompt as the engine decodes it: token ids and its own options."""

    ids: List[int]
    max_tokens: int
    temperature: float = 0.0
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    index: int = 0  # the caller's position for it
    sample: int = 0  # which sample of its prompt (the same ids, its own seed)
    urgent: bool = False  # interactive (dflash_batch/inbox.py): never gives its slot up
    requeued: bool = False  # gave its slot up to an urgent one once, and keeps it from now on
    # the filters and penalties (engine/sampling.py), checked; off by default
    controls: SamplingControls = field(default_factory=SamplingControls)
    # from the controls (Engine.request): logprobs and top_logprobs, response_format
    # None: none; k: the emitted token's and the k best alternatives'
    logprobs: Optional[int] = None
    grammar: Optional[str] = None  # llguidance grammar (dflash_batch/constraints.py)
    # decoded plainly in the batch, drafts never verified: a check (docs/runner.md)
    control: bool = False


@dataclass
class Row:
    """A request in a slot of the batch."""

    request: EncodedRequest
    output: RowOutput
    seed: int  # of the row's sampling noise (engine/decode.py: choose)
    last: int = 0  # the newest committed token, not yet in the target cache
    produced: int = 0  # tokens committed so far (the prefill's first one included)
    acceptance: Acceptance = field(default_factory=Acceptance)
    history: List[int] = field(default_factory=list)  # committed output tokens (for penalties)
    # the grammar state at the committed output (engine/grammar.py)
    matcher: Optional[object] = None
    # no penalty, filter or grammar: chooses from the target's logits as they are
    plain: bool = False

    @property
    def budget(self) -> int:
        return self.request.max_tokens - self.produced

    @property
    def cycle_budget(self) -> int:
        """The most one cycle may commit for this row: its budget, or 1 for a control row (only
        the target's own token: decoded plainly whatever the width)."""
        return 1 if self.request.control else self.budget


class BatchDecoder:
    """Decodes ``requests`` (a list, or a ``Waiting`` over a stream) with at most ``slots`` rows
    in flight (fewer once ``plan.rows`` is lower); ``steps()`` yields ``(request index, Piece)``
    as rows commit tokens (a Piece with ``finish_reason`` ends a row), ``(request index, error)``
    for a row that failed alone (its grammar: the other rows go on), and ``(None, None)`` after
    the stream gave a refused request (``requests.refused``), so that the caller can report it."""

    def __init__(
        self,
        engine,
        requests: Union[Sequence[EncodedRequest], Waiting],
        slots: int,
        width_policy: WidthPolicy,
        plan=None,
        capacity: int = 0,
        urgent: Optional[Callable[[], List[List[EncodedRequest]]]] = None,
        cancelled: Optional[Callable[[EncodedRequest], bool]] = None,
    ):
        self.engine, self.target, self.drafter = engine, engine.target, engine.drafter
        # interactive requests (dflash_batch/inbox.py): ``urgent()`` hands over those arrived since
        # the last step, which go ahead of the waiting ones; ``cancelled(request)`` drops a row
        self.urgent, self.cancelled = urgent, cancelled
        # Joining prompts (engine/prefill.py): prefilled together, sharing the prefixes they have in common.
        self.prefixes = engine.prefixes
        if not isinstance(requests, Waiting):
            requests = Waiting(
                [list(requests)], None, self.prefixes.granularity if self.prefixes else None
            )
            requests.refill()
        self.waiting = requests
        self.plan = plan  # memory.Plan of a stream: its ``rows`` caps the rows in flight
        # a batch whose requests are all known is as wide as they are; one that interactive
        # requests may join (``urgent``) keeps every slot
        self.slots = max(
            1, min(slots, len(requests)) if requests.done and urgent is None else slots
        )
        self.width_policy = width_policy
        width_policy.new_shape = self._new_shape  # a shape's first pass compiles (engine/widths.py)
        self.rows: List[Optional[Row]] = [None] * self.slots
        self.group = prefill.JoinGroup(
            self.target, self.drafter, self.prefixes, engine.prefill_cost
        )
        # Device state of the batch: target cache rows, drafter context rows, pending context.
        self.lengths = Lengths([0] * self.slots)
        # allocated once for the longest row the memory plan allows for (``capacity`` positions):
        # growing a batch's cache copies it, and for that moment it needs twice its memory.
        # Passes that compile see the buffers whole, at a width of their ladder (engine/ops/compiled.py).
        capacity = self._capacity(capacity)
        self.cache = self.target.make_cache(self.lengths, capacity)
        self.draft_lengths = Lengths([0] * self.slots) if self.drafter else None
        self.draft_cache = (
            self.drafter.make_cache(self.draft_lengths, capacity) if self.drafter else None
        )
        # new context rows the drafter has not seen: each cycle's tapped rows [B, T, H] and the rows
        # each row kept, packed once when the drafter runs (decode.pack_context)
        self.pending: List[Tuple[mx.array, List[int]]] = []
        # per slot, its prompt's tapped rows [1, n, H] (engine/prefill.py), written into the drafter's
        # cache by the first cycle that drafts: a job decoded plainly never runs the drafter on them
        self.prompts: Dict[int, mx.array] = {}
        # the drafter's context writes outside its drafting passes: calls, rows, seconds
        self.context_counts = {"writes": 0, "rows": 0, "seconds": 0.0}
        # Decoding cycles, plain data: per verify width T, [cycles, seconds, rows in flight summed]
        self.decode_counts: Dict[int, List[float]] = {}
        self.last_width = 1  # the verify width of the last cycle's pass

    def _capacity(self, positions: int) -> int:
        """``positions``, or the compiled passes' rung above it where the memory holds that."""
        rung = compiled.capacity(self.slots, positions)
        if (
            rung == positions
            or memory.rows_that_fit(memory.row_bytes(self.engine, rung)) < self.slots
        ):
            return positions
        return rung

    # -- the engine step --------------------------------------------------------------------
    def steps(self) -> Iterator[Tuple[int, Piece]]:
        # Buffers MLX keeps for reuse (an earlier job's, the warm-up's) do not count as used in
        # the memory plan; on CUDA an allocation that finds the device full fails rather than
        # freeing them, so they are freed before the job allocates its own.
        mx.clear_cache()
        mx.reset_peak_memory()
        while True:
            if self.urgent is not None:
                self.waiting.push_front(self.urgent())
            if self.cancelled is not None:
                yield from self._cancel()
            if not (self.waiting or self.group.joiners or any(self.rows)):
                return
            yield from self.admit()
            if self.waiting.refused:
                self.waiting.refused = 0
                yield None, None
            live = [b for b, r in enumerate(self.rows) if r is not None]
            if not live:
                continue
            rows = [self.rows[b] for b in live]
            width = self.width_policy.width(
                [r.acceptance for r in rows], [r.cycle_budget for r in rows], self._tail(rows)
            )
            yield from self.postprocess(self.run(width))
            self.shrink()

    # -- schedule: admission ------------------------------------------------------------------
    def admit(self) -> Iterator[Tuple[int, Piece]]:
        """Prefill waiting requests into free slots, ``prefill_chunk`` prompt tokens per free slot
        per step, the joining prompts packed into shared passes (engine/prefill.py): decoding rows
        wait for about one chunk when one slot is free, and a batch that is mostly free (few rows
        to hold up, a pass mostly wasted) fills at once."""
        if self.waiting.urgent:
            yield from self._preempt()
        if self._gather():
            return
        free = sum(r is None for r in self.rows)
        budget = self.engine.prefill_chunk * max(free, 1)
        while True:
            yield from self._fill()
            if not self.group.joiners or budget <= 0:
                return
            budget -= yield from self._prefill_pass(self._pass_width())

    def _gather(self) -> bool:
        """Whether to leave the free slots empty for one more cycle, so that the requests joining
        now join with those joining later in one prefill pass. A row with d tokens of budget
        left ends within d cycles, whatever their widths: admitting now and again then runs two
        passes where waiting runs one, and saves the fixed part of a pass (``PrefillCost``),
        which every decoding row waits for; the free slots left empty lose their share of up to
        d cycles, free / slots of d cycles' measured seconds. It waits where the pass saved
        costs more, for the row that ends soonest, and weighs again every cycle. Not where no
        more requests wait than the free slots take, or a pass takes no more prompts than there
        are free slots (``prefill_rows``): no later pass to save. Nor while rows
        are part prefilled, an urgent request waits (its first token would come later), or
        before a pass's fixed part or a cycle's seconds are known (this job's cycles: the rows
        then in flight decide what a cycle costs). Rows that end early (EOS) are not foreseen."""
        free = sum(r is None for r in self.rows)
        live = [r.budget for r in self.rows if r is not None]
        # no more waiting than the free slots take (one pass admits them all now), or a pass
        # takes no more prompts than there are free slots (the later ones would need their own)
        if not (free and live and len(self.waiting) > free) or self.group.joiners:
            return False
        if (self.engine.prefill_rows or self.slots) <= free:
            return False
        if self.waiting.urgent:
            return False
        fixed, cycles = self.group.cost.fixed(), self.decode_counts.values()
        count = sum(n for n, _, _ in cycles)
        if fixed is None or not count:
            return False
        cycle = sum(s for _, s, _ in cycles) / count
        return fixed > free / self.slots * min(live) * cycle

    def _preempt(self) -> Iterator[Tuple[int, Exception]]:
        """Urgent requests wait and no slot is free: as many batch rows as they need give their
        slots up, the least advanced first; each goes back to wait right behind them and starts
        again from its prompt (its pieces so far are dropped: ``Requeued``). A row gives its slot
        up once at most, so every row finishes."""
        taken = {j.slot for j in self.group.joiners}
        free = sum(r is None and b not in taken for b, r in enumerate(self.rows))
        need = self.waiting.urgent - free
        if need <= 0 or (self.plan is not None and self.slots > self.plan.rows):
            return
        movable = sorted((r.produced, b) for b, r in enumerate(self.rows)
                         if r is not None and not r.request.urgent and not r.request.requeued)  # fmt: skip
        gone = [b for _, b in movable[:need]]
        for b in gone:
            request, self.rows[b] = self.rows[b].request, None
            request.requeued = True
            self.waiting.push_front([[request]], urgent=False)
            yield request.index, Requeued()
        self._free(gone)

    def _pass_width(self) -> int:
        """Tokens per row in the next packed pass: a chunk, less when many rows would pass more than
        ``prefill_tokens`` tokens in all."""
        rows = len(self.group.joiners)
        return max(1, min(self.engine.prefill_chunk, self.engine.prefill_tokens // rows))

    def _fill(self) -> Iterator[Tuple[int, Piece]]:
        """Start a waiting request in each free slot: from the longest kept prefix of its prompt (a
        whole prompt kept takes its slot at once), else from nothing. A request waits while a
        joining row is about to keep a longer prefix of its prompt. None joins while the batch is
        wider than its plan allows (a longer request arrived) and cannot narrow yet."""
        if (
            self.plan is not None
            and self.slots > self.plan.rows
            and not self.narrow(self.plan.rows)
        ):
            return
        taken = {j.slot for j in self.group.joiners}
        most = self.engine.prefill_rows or self.slots
        for b in range(self.slots):
            if self.rows[b] is not None or b in taken:
                continue
            if (
                len(self.group.joiners) >= most
                or self.group.pending() >= self.engine.prefill_tokens
            ):
                return  # the group holds a pass's worth: more joiners would only hold their caches twice
            entry = self.waiting.peek()
            if entry is None:
                return
            if self.plan is not None and self.slots > self.plan.rows:  # the pull lowered the plan
                yield from self._fill()
                return
            request, marks = entry
            start = self.prefixes.longest(request.ids) if self.prefixes else None
            if self.group.waits_for(request.ids, start.length if start else 0):
                return
            self.waiting.pop()
            try:
                row = self._new_row(request)
            except Exception as e:  # this request's own setup (its grammar's matcher): its error
                yield request.index, e
                continue
            if start is not None and start.length == len(request.ids):
                yield from self._place([(b, row, start)])
            else:
                self.group.add(prefill.Joiner(row, b, request.ids, 0, list(marks)), start)

    def _new_row(self, request: EncodedRequest) -> Row:
        engine = self.engine
        output = RowOutput(
            engine.tokenizer,
            len(request.ids),
            request.max_tokens,
            request.stop,
            engine.block_size,
            request.control,
        )
        output.start()
        seed = request.seed if request.seed is not None else decode.new_seed()
        matcher = engine.grammars.matcher(request.grammar) if request.grammar is not None else None
        plain = matcher is None and not (sampling.penalized(request) or sampling.filtered(request))
        return Row(
            request,
            output,
            seed,
            acceptance=self.width_policy.new_row(),
            matcher=matcher,
            plain=plain,
        )

    def _prefill_pass(self, width: int):
        """One packed pass over the joining rows (returns the prompt tokens it prefilled); the rows
        whose prompt is complete take their slots and emit their first tokens."""
        before = self.group.counts["tokens"]
        yield from self._place(
            [(joiner.slot, joiner.row, state) for joiner, state in self.group.prefill(width)]
        )
        return self.group.counts["tokens"] - before

    def _place(self, placed: List[Tuple[int, Row, prefill.Prefix]]) -> Iterator[Tuple[int, Piece]]:
        """Copy prompts' prefilled states into their slots b; each row chooses its first token from
        its prompt's last logits (position n, its own seed) and emits it. The rows placed together
        choose together: one choice and one host sync for all of them, not one per row."""
        if not placed:
            return
        lengths, draft_lengths = (
            list(self.lengths.host),
            list(self.draft_lengths.host) if self.drafter else None,
        )
        for b, row, state in placed:
            for big, small in zip(self.cache, state.target):
                big.put_row(b, small, self.slots)
            lengths[b] = state.length
            self.rows[b] = row
        self._drop_pending([b for b, _, _ in placed])
        for b, row, state in placed if self.drafter is not None else ():
            self.context_shape = state.context  # width and dtype of tapped context rows
            draft_lengths[b] = 0  # the prompt's context waits in ``prompts`` until the drafter runs
            if (
                state.hidden is not None and not row.request.control
            ):  # a control row's drafts are never verified
                self.prompts[b] = state.hidden
        self.lengths.set(lengths)
        if self.drafter is not None:
            self.draft_lengths.set(draft_lengths)
        mx.eval([c.arrays() for c in self.cache])
        logits = mx.concatenate([state.logits for _, _, state in placed], axis=0)  # [rows, 1, V]
        rows = [row for _, row, _ in placed]
        chosen, scores = self.choose(
            logits, rows, mx.array([state.length for _, _, state in placed])
        )
        for i, ((b, row, _), first) in enumerate(zip(placed, chosen[:, 0].tolist())):
            row.last = first
            row.produced = 1
            step = Step(tokens=[first], logprobs=_logprobs(scores, i, 1))
            yield from self._emit(b, self._commit(row, [first]) or step)

    def choose(
        self,
        logits: mx.array,
        rows: Sequence[Optional[Row]],
        first: mx.array,
        drafted: Optional[mx.array] = None,
        drafts: Optional[List[List[int]]] = None,
    ):
        """Each row's token at every position of a pass [B, T] (position i after the row's
        committed output and its drafts d_1..d_i; engine/sampling.py), and the raw logprobs of
        the rows that asked for them (None if none did)."""
        B, T, _ = logits.shape
        if all(r is None or r.plain for r in rows):
            # what sampling.process returns when no row has a control or a grammar
            processed = logits
        else:
            walks = [
                (b, r.matcher, drafts[b] if drafts else [])
                for b, r in enumerate(rows)
                if r is not None and r.matcher is not None
            ]
            allowed = self.engine.grammars.masks(walks, B, T) if walks else None
            requests = [r.request if r is not None else None for r in rows]
            processed = sampling.process(
                logits, requests, [r.history if r else [] for r in rows], drafted, allowed
            )
        chosen = decode.choose(
            processed,
            [r.request.temperature if r else 0.0 for r in rows],
            [r.seed if r else 0 for r in rows],
            first,
        )
        tops = [
            r.request.logprobs for r in rows if r is not None and r.request.logprobs is not None
        ]
        if not tops:
            return chosen, None
        scores = sampling.logprobs(logits, chosen, max(tops))
        mx.eval(chosen, *[x for x in scores if x is not None])
        return chosen, [x.tolist() if x is not None else None for x in scores] + [
            [r.request.logprobs if r else None for r in rows]
        ]

    def _commit(self, row: Row, tokens: List[int]) -> Optional[Exception]:
        """A row's new committed tokens join its history and advance its grammar (up to an EOS).
        Returns the error that ends this row alone, if its grammar fails."""
        row.history += tokens
        if row.matcher is None:
            return None
        try:
            if not row.matcher.is_stopped():
                eos = next((i for i, tok in enumerate(tokens) if tok in row.output.eos), None)
                upto = tokens if eos is None else tokens[: eos + 1]
                self.engine.grammars.commit(row.matcher, upto)
        except Exception as e:  # one row's grammar state: the batch goes on without it
            return e
        return None

    # -- run: one cycle ---------------------------------------------------------------------------
    def run(self, width: int) -> List[Union[Step, Exception, None]]:
        """One cycle of verify width T over every slot; returns each live row's Step (or the
        error that ended it alone)."""
        if (
            self.drafter is not None
        ):  # before the cycle's clock starts: prefill work, not the cycle's
            self._write_pending(width)
        started = time.perf_counter()
        rows = self.rows
        B = self.slots
        last = mx.array([[r.last if r is not None else 0] for r in rows], dtype=mx.int32)
        prefixes = self._draft_tree(last, width) if self._tree_cycle(width) else None
        if prefixes is not None:  # the width, chosen again from the drafts themselves
            live = [(p, r) for p, r in zip(prefixes, rows) if r is not None]
            width = self.width_policy.tree_width(
                [(p.depths, p.scores) for p, _ in live], [r.cycle_budget for _, r in live]
            )
        # L_b: what row b may commit
        limits = [min(width, r.cycle_budget) if r is not None else 1 for r in rows]
        # the pass runs at a bucket width (engine/widths.py: ``buckets``), compiled once: near
        # the end of their budgets the rows' limits would make any width; a row's positions past
        # its L_b are verified and discarded, as a short-budget row's beside a long one's are
        T = self.last_width = bucket(max(limits), self.width_policy.block)
        # reach_b: the deepest draft position row b's pass could accept, plus one (the width policy's
        # "verified": a chain's L_b; a tree's deepest node + 1, so that depths it never held do
        # not count as rejected)
        if prefixes is not None:
            committed, hidden, scores, reach = self._verify_tree(prefixes, T, limits)
        else:
            committed, hidden, scores = self._verify_chain(last, T, limits)
            reach = limits
        keep = [len(c) for c in committed]  # last_b and the accepted drafts: a_b + 1 rows
        self.target.rollback(self.cache, keep)
        self.lengths.advance(keep)
        if hidden is not None:
            self.pending.append((hidden, list(keep)))  # a piece: packed when the drafter runs
        live = sum(r is not None for r in rows)
        # a cycle of shapes not run before includes compiling them
        shapes = (
            B,
            T,
            round_up(self.lengths.max),
        )
        seconds = time.perf_counter() - started
        if shapes in self.engine.shapes_seen:
            # a tree probe drafted the probe's positions alone, where the tree cycles the cost
            # model prices draft the block's: not what a cycle of its width costs
            if not (prefixes is not None and self.width_policy.probe):
                self.width_policy.cost.observe(live, T, seconds)
        elif self._new_shape(T):  # what compiling it cost (engine/widths.py: ``CompileCost``)
            self.width_policy.compile.observe(seconds - self.width_policy.cost.cycle(live, T))
        self.engine.passes_run.add((B, T))
        counts = self.decode_counts.setdefault(T, [0, 0.0, 0])
        counts[0] += 1
        counts[1] += seconds
        counts[2] += live
        self.engine.shapes_seen.add(shapes)
        plain = self._plain_cycle(live, seconds)
        steps: List[Optional[Step]] = [None] * B
        for b, r in enumerate(rows):
            if r is None:
                continue
            a = keep[b] - 1
            r.output.timed(seconds / live, None if plain is None else plain / live)
            self.width_policy.accepted(r.acceptance, a, reach[b])
            r.last = committed[b][-1]
            r.produced += a + 1
            logprobs = _logprobs(scores, b, a + 1) if scores is not None else None
            step = Step(committed[b], a, limits[b] - 1, True, logprobs)
            steps[b] = self._commit(r, committed[b]) or step
        return steps

    def _new_shape(self, T: int, rows: int = 0) -> bool:
        """Whether a pass of width T at ``rows`` (the batch's) would be the process's first of
        that shape: neither run nor timed at warm-up."""
        rows = rows or self.slots
        cost = self.width_policy.cost
        timed = rows == cost.rows and T in cost.timed
        return (rows, T) not in self.engine.passes_run and not timed

    def _plain_cycle(self, live: int, seconds: float) -> Optional[float]:
        """What a plain cycle over ``live`` rows costs, for what speculation saved: without a
        drafter, this cycle's own seconds (it was one); else the cost model's width-1 cycle at
        this batch size (measured passes, and the excess its timed cycles showed); None for a
        fixed width, whose cost model was never measured."""
        if self.drafter is None:
            return seconds
        if self.width_policy.fixed:
            return None
        return self.width_policy.cost.cycle(live, 1)

    def _verify_chain(self, last: mx.array, T: int, limits: List[int]):
        """Draft T - 1 tokens per row, verify them in one pass, accept the longest agreeing prefix
        (engine/decode.py). Returns per row the committed tokens (the accepted drafts, then the
        bonus), the pass's tapped rows and the logprobs asked for."""
        rows = self.rows
        if T > 1:
            drafted = self.draft(last, T - 1)
            mx.async_eval(drafted)  # the device drafts while the host builds the verify graph
        else:
            drafted = mx.zeros((self.slots, 0), dtype=mx.int32)
        tokens = mx.concatenate([last, drafted], axis=1)
        logits, hidden = self.target.decode_pass(tokens, self.cache)
        drafts = None
        if any(r is not None and r.matcher is not None for r in rows):
            # grammar masks walk the drafts on the host: queue the verify pass, then fetch the
            # drafts (queued on their own above: an array waits for the whole graph it was queued
            # with) and compute the masks while it runs
            mx.async_eval(logits)
            drafts = drafted.tolist()
        chosen, scores = self.choose(
            logits,
            rows,
            self.lengths.device + 1,  # verify row i picks the token after position n_b + i
            drafted if T > 1 else None,
            drafts,
        )
        # the cycle's one host sync (two with grammars): the drafts were queued first, the verify
        # pass behind them (fetching the drafts alone would leave the device idle until it is built)
        mx.eval(drafted, chosen)
        d, t = drafted.tolist(), chosen.tolist()
        accepted = decode.accept_lengths(d, t, limits)
        return [d[b][:a] + [t[b][a]] for b, a in enumerate(accepted)], hidden, scores

    def _tree_cycle(self, T: int) -> bool:
        """Whether this cycle verifies draft trees (engine/tree.py): where the mode and the target
        allow, wider than one draft, and every row choosing from the target's logits as they are,
        with no logprobs asked (its tokens depend on nothing but the node's prefix and position).
        An adaptive width policy chooses a tree's width again from its drafts, so any drafting width
        starts one."""
        drafting = T > 2 or (T == 2 and not self.width_policy.fixed)
        return (
            drafting
            and self.drafter is not None
            and not self.drafter.selects
            and self.target.trees
            and self.engine.settings.drafts == "tree"
            and all(r is None or (r.plain and r.request.logprobs is None) for r in self.rows)
        )

    def _draft_tree(self, last: mx.array, width: int) -> List[tree.Prefixes]:
        """The drafter's candidates per position, and each row's best-first prefixes over them
        (engine/tree.py), as many as any width could verify (at most L_b - 1 deep): the width policy
        chooses the cycle's width from them. A fixed width, or a probe, drafts only the positions
        it verifies."""
        block = self.engine.block_size
        longest = max(r.cycle_budget for r in self.rows if r is not None)
        # the drafter's head rows too; a probe's tree no wider than the probe (engine/widths.py)
        wide = width if self.width_policy.fixed or self.width_policy.probe else block
        top = bucket(min(wide, longest), block)
        P = min(top - 1, block - 1)
        ids, logprobs = self.draft(last, P, candidates=tree.CANDIDATES)
        mx.eval(ids, logprobs)  # the tree is grown on the host
        return tree.best_first(
            [r.last if r is not None else 0 for r in self.rows],
            np.array(ids),
            np.array(logprobs),
            [min(top, r.cycle_budget) - 1 if r is not None else 0 for r in self.rows],
        )

    def _verify_tree(self, prefixes: List[tree.Prefixes], T: int, limits: List[int]):
        """A draft tree's cycle (engine/tree.py): each row's tree, its first L_b - 1 prefixes, in
        one pass over the nodes at their depths, then the walk; the accepted path moves to the
        front of the row's columns."""
        rows = self.rows
        trees = tree.fit(prefixes, limits, T)
        tokens, depth, ancestors = trees.device()
        self.lengths.tree = (depth, ancestors)
        try:
            logits, hidden = self.target.decode_pass(tokens, self.cache)
        finally:
            self.lengths.tree = None
        # node i picks the token after its prefix: position n_b + depth_i + 1
        chosen, _ = self.choose(logits, rows, self.lengths.device[:, None] + depth + 1)
        t = chosen.tolist()
        paths = tree.walk(trees, t)
        kept = max(len(p) for p in paths)  # columns that must hold the paths: n_b .. n_b + kept - 1
        order = [o[:kept] for o in tree.order(paths, T)]
        if any(o != list(range(kept)) for o in order):
            index = mx.array(order, dtype=mx.int32)
            self.target.reorder(self.cache, index)
            if hidden is not None:
                hidden = mx.take_along_axis(hidden, index[..., None], axis=1)
        elif hidden is not None:
            hidden = hidden[:, :kept]
        for p, r, L, path in zip(prefixes, rows, limits, paths):
            if r is not None:
                n = p.verified(L)
                self.width_policy.tree_accepted(p.depths[:n], p.scores[:n], len(path) - 1)
        committed = [
            [trees.tokens[b][i] for i in p[1:]] + [t[b][p[-1]]] for b, p in enumerate(paths)
        ]
        return committed, hidden, None, [max(d) + 1 for d in trees.depths]

    @property
    def pending_counts(self) -> List[int]:
        """Per row, the pending context rows the drafter has not seen (its prompt's, and the
        cycles' summed over the pieces)."""
        counts = [sum(c) for c in zip(*(c for _, c in self.pending))] or [0] * self.slots
        for b, hidden in self.prompts.items():
            counts[b] += hidden.shape[1]
        return counts

    def write_prompts(self) -> None:
        """Write the prompts' context rows waiting in ``prompts`` into the drafter's cache (the
        first cycle that drafts after they joined pays for them, once): rows of similar length
        together, about a packed prefill pass's worth of rows at a time, each pack one context
        pass of the drafter (all from position 0) and each row then copied into its slot."""
        if not self.prompts:
            return
        started = time.perf_counter()
        lengths = list(self.draft_lengths.host)
        for pack in _packs(
            sorted(self.prompts, key=lambda b: self.prompts[b].shape[1]),
            lambda b: self.prompts[b].shape[1],
            self.engine.prefill_tokens,
        ):
            self._write_pack(pack)
            for b in pack:
                lengths[b] = self.prompts[b].shape[1]
        self.draft_lengths.set(lengths)
        mx.eval([c.arrays() for c in self.draft_cache])
        self.context_counts["writes"] += 1
        self.context_counts["rows"] += sum(h.shape[1] for h in self.prompts.values())
        self.context_counts["seconds"] += time.perf_counter() - started
        self.prompts = {}

    def _write_pack(self, pack: List[int]) -> None:
        """The drafter's context K/V of these slots' prompts (padded to the longest: a padding
        row's keys come after every valid one and are never copied), placed at columns 0..n_b - 1
        of each slot b (whose drafter context is empty until then)."""
        counts = [self.prompts[b].shape[1] for b in pack]
        width = max(counts)
        rows = [
            self.prompts[b]
            if n == width
            else mx.pad(self.prompts[b], [(0, 0), (0, width - n), (0, 0)])
            for b, n in zip(pack, counts)
        ]
        lengths = Lengths([])
        # empty at first, as the joining group's (engine/prefill.py)
        cache = self.drafter.make_cache(lengths)
        lengths.set([0] * len(pack))
        self.drafter.add_context(mx.concatenate(rows, axis=0) if len(rows) > 1 else rows[0], cache)
        for i, (b, n) in enumerate(zip(pack, counts)):
            for big, small in zip(self.draft_cache, cache):
                big.put_row(
                    b, (small.keys[i : i + 1, :, :n], small.values[i : i + 1, :, :n]), self.slots
                )

    def _write_pending(self, width: int) -> None:
        """Before a cycle of verify width ``width``: a drafting one (wider than 1) first writes the
        prompts' rows into the drafter's cache; so does any cycle once pending context is past its
        bound (``PENDING_PASSES``), and if the cycles' pieces alone are still past it, one
        drafting pass (its drafts unused) takes them."""
        bound = PENDING_PASSES * self.engine.prefill_tokens
        if width > 1 or self._held() > bound:
            self.write_prompts()
        if self._held() > bound:
            started = time.perf_counter()
            last = mx.array([[r.last if r is not None else 0] for r in self.rows], dtype=mx.int32)
            mx.eval(self.draft(last, 1))
            self.context_counts["writes"] += 1
            self.context_counts["seconds"] += time.perf_counter() - started

    def _held(self) -> int:
        """Context rows pending context holds in memory: the prompts', and every piece's whole
        [B, T] (rows that left still take their place until the piece is packed)."""
        return sum(h.shape[1] for h in self.prompts.values()) + sum(
            r.shape[0] * r.shape[1] for r, _ in self.pending
        )

    def draft(self, last: mx.array, rows: int, candidates: int = 0):
        """The drafter takes every row's pending context and proposes ``rows`` tokens per row; with
        ``candidates``, that many per position and their log-probabilities instead (a draft tree's)."""
        self.write_prompts()  # written before the cycle began (``run``), unless called on its own
        context, counts = decode.pack_context(self.pending)
        counts = counts or [0] * self.slots
        uniform = len(set(counts)) == 1 and self.draft_lengths.uniform
        if context is None:  # no row has new context (all just joined)
            context = mx.zeros(
                (len(counts), 0, self.context_shape.shape[-1]), self.context_shape.dtype
            )
        row_counts = None if uniform else mx.array(counts, dtype=mx.int32)
        if candidates:
            drafted = decode.draft_candidates(
                self.drafter,
                self.target,
                last,
                context,
                row_counts,
                self.draft_cache,
                rows,
                candidates,
                head=self.engine.draft_head,
            )
        else:
            drafted = self._draft_block(last, context, row_counts, rows)
        self.draft_lengths.advance(counts)
        self.pending = []
        return drafted

    def _draft_block(
        self, last: mx.array, context: mx.array, counts: Optional[mx.array], rows: int
    ) -> mx.array:
        """``rows`` draft tokens per row; constrained rows along their grammar when asked."""
        walking = (
            [b for b, r in enumerate(self.rows) if r is not None and r.matcher is not None]
            if self.engine.grammar_drafts
            else []
        )
        drafted = decode.draft_block(
            self.drafter,
            self.target,
            last,
            context,
            counts,
            self.draft_cache,
            rows,
            head=self.engine.draft_head,
            **({"with_logits": True} if walking else {}),
        )
        if not walking:
            return drafted
        # constrained rows draft along their grammar (engine/grammar.py: Grammars.draft)
        ids, logits = drafted
        ids = ids.tolist()
        picked = self.engine.grammars.draft(
            [self.rows[b].matcher for b in walking],
            [ids[b] for b in walking],
            logits[mx.array(walking, dtype=mx.int32)],
        )
        for b, d in zip(walking, picked):
            ids[b][: len(d)] = d
        return mx.array(ids, dtype=last.dtype)

    # -- postprocess ------------------------------------------------------------------------------
    def postprocess(self, steps: List[Union[Step, Exception, None]]):
        finished: List[int] = []
        try:
            for b, step in enumerate(steps):
                if step is not None:
                    yield from self._emit(b, step, finished)
        finally:
            self._free(finished)

    def _emit(self, b: int, step: Union[Step, Exception], finished: Optional[List[int]] = None):
        """Feed row b's step to its output and yield the piece (or yield the error that ended the
        row); a finished row's slot is freed at once, or with the cycle's other finished rows
        when ``finished`` collects them."""
        row = self.rows[b]
        piece = step if isinstance(step, Exception) else row.output.feed(step)
        yield row.request.index, piece
        if isinstance(piece, Exception) or piece.finish_reason is not None:
            if not isinstance(piece, Exception):
                self.engine.ends.observe(piece.finish_reason == "length")
            self.rows[b] = None  # the slot is free
            if finished is None:
                self._free([b])
            else:
                finished.append(b)

    def _cancel(self) -> Iterator[Tuple[int, Exception]]:
        """Drop the cancelled requests: rows in flight free their slot, waiting ones leave the
        queue (a prompt mid-prefill is dropped once it holds its row)."""
        gone = [b for b, r in enumerate(self.rows) if r is not None and self.cancelled(r.request)]
        for b in gone:
            index, self.rows[b] = self.rows[b].request.index, None
            yield index, Cancelled("the client went away")
        self._free(gone)
        for request in self.waiting.drop(self.cancelled):
            yield request.index, Cancelled("the client went away before it started")

    def _free(self, slots: List[int]) -> None:
        """Freed slots hold nothing: length 0, no pending context (one device update for all)."""
        if not slots:
            return
        self.lengths.set(_replace(self.lengths.host, slots, 0))
        if self.drafter is not None:
            self.draft_lengths.set(_replace(self.draft_lengths.host, slots, 0))
        self._drop_pending(slots)

    def _drop_pending(self, slots: List[int]) -> None:
        """These slots' pending context rows are no longer valid (their row left, or a new one took it)."""
        for _, counts in self.pending:
            for b in slots:
                counts[b] = 0
        self.pending = [(rows, counts) for rows, counts in self.pending if any(counts)]
        for b in slots:
            self.prompts.pop(b, None)

    def shrink(self) -> None:
        """With nothing left to come, drop idle rows from the batch once its live rows fit a
        smaller batch size of the ladder (``batch_rung``), keeping idle rows up to that size: a
        job's tail then runs a handful of batch shapes, each compiled and costed once per
        machine, not one shape per row that finishes; and only where the rows dropped save more
        than a rung not yet run costs to compile (``_shrink_pays``). Interactive requests may come
        at any time (``urgent``): their slots are kept."""
        if not self._closed():
            return
        live = [b for b, r in enumerate(self.rows) if r is not None]
        rung = batch_rung(len(live))
        if not live or rung >= self.slots or not self._shrink_pays(rung, live):
            return
        idle = [b for b, r in enumerate(self.rows) if r is None]
        self._keep(sorted(live + idle[: rung - len(live)]))

    def _closed(self) -> bool:
        """Whether no request can join the batch any more: none waits or joins, the stream has
        ended, and no interactive request may come (``urgent``). The job's tail: it ends when its
        slowest row does (engine/widths.py, "The job's tail")."""
        return not (self.waiting or self.group.joiners or self.urgent is not None)

    def _tail(self, rows: List[Row]) -> Optional[List[int]]:
        """The tokens each live row's slot has left to decode once the job's end is in sight
        (engine/widths.py, "The job's tail"), else None: none can join any more, or the last
        wave, where every request still waiting takes a slot one of these rows frees (all of
        them known, none joining, no interactive one to come, no more than there are rows). The
        rows with the fewest tokens left free their slots first and take them in turn, after the
        slots empty now (left so for a gathered join: ``_gather``) have taken the first waiting
        requests; those start afresh as rows of their own when they join, and the tail is weighed
        again then. The last wave only where most rows run to their budgets (``finish.Ends``):
        its slots' tokens left are budgets."""
        left = [r.budget for r in rows]
        if self._closed():
            return left
        waiting = self.waiting.peeked()
        if not self.waiting.done or self.urgent is not None or self.group.joiners:
            return None
        queued = waiting[sum(r is None for r in self.rows) :]  # past the empty slots
        if len(queued) > len(rows) or not self.engine.ends.run_to_budgets():
            return None
        for b, request in zip(sorted(range(len(rows)), key=left.__getitem__), queued):
            left[b] += request.max_tokens
        return left

    def _shrink_pays(self, rung: int, live: List[int]) -> bool:
        """Whether dropping to ``rung`` rows saves more than a new shape's compile (engine/widths.py,
        "What a new shape costs"): target(slots, T) - target(rung, T) a cycle at the width last
        run, for about the live rows' mean budget in cycles. Where nothing compiles (K = 0) or
        that shape has run, it always does."""
        compile, T = self.width_policy.compile.estimate(), self.last_width
        if not compile or not self._new_shape(T, rung):
            return True
        cost = self.width_policy.cost
        cycles = sum(self.rows[b].cycle_budget for b in live) / len(live)
        return (cost.target(self.slots, T) - cost.target(rung, T)) * cycles >= compile

    def narrow(self, rows: int) -> bool:
        """Cut the batch to ``rows`` slots (its live rows and idle ones) once no more than that
        many are live and none is joining; returns whether it is that narrow."""
        if self.slots <= rows:
            return True
        live = [b for b, r in enumerate(self.rows) if r is not None]
        if self.group.joiners or len(live) > rows:
            return False
        idle = [b for b, r in enumerate(self.rows) if r is None]
        self._keep(sorted(live + idle[: rows - len(live)]))
        return True

    def _keep(self, keep: List[int]) -> None:
        """Keep only these slots of the batch, in this order."""
        index = mx.array(keep, dtype=mx.int32)
        for c in self.cache + (self.draft_cache or []):
            c.take_rows(index)
        self.rows = [self.rows[b] for b in keep]
        self.lengths.set([self.lengths.host[b] for b in keep])
        if self.drafter is not None:
            self.draft_lengths.set([self.draft_lengths.host[b] for b in keep])
        self.pending = [(rows[index], [counts[b] for b in keep]) for rows, counts in self.pending]
        self.prompts = {i: self.prompts[b] for i, b in enumerate(keep) if b in self.prompts}
        self.slots = len(keep)


def _packs(items: List[int], size: Callable[[int], int], tokens: int) -> Iterator[List[int]]:
    """``items`` (in order) in runs whose count times their largest ``size`` stays within
    ``tokens`` (a run holds one item at least)."""
    pack: List[int] = []
    for item in items:
        if pack and (len(pack) + 1) * max(size(item), max(size(i) for i in pack)) > tokens:
            yield pack
            pack = []
        pack.append(item)
    if pack:
        yield pack


def _logprobs(scores, b: int, count: int):
    """Row b's logprobs of its first ``count`` positions: [(logprob, [(id, logprob), ...])], or None."""
    if scores is None or scores[3][b] is None:
        return None
    picked, best, values, tops = scores
    top = tops[b]
    return [
        (picked[b][i], list(zip(best[b][i][:top], values[b][i][:top])) if best is not None else [])
        for i in range(count)
    ]


def _replace(values: List[int], at: Union[int, Sequence[int]], v: int) -> List[int]:
    out = list(values)
    for i in [at] if isinstance(at, int) else at:
        out[i] = v
    return out
