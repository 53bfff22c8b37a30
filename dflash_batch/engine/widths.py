"""How wide each cycle verifies: a cost model of target and drafter passes, and each row's
acceptance, choose the width T that commits the most tokens per second (at a job's tail, the one
that finishes its rows soonest).

For row b, p_bk is the chance that draft k is accepted given drafts 1..k-1 were (estimated per
position k: a drafter is often wrong at its first token and, once right, right for a run, so one
p for every position overrates wide blocks). Verifying L rows commits on average

    E_b(L) = 1 + p_b1 + p_b1 p_b2 + ... + p_b1 ... p_b(L-1)      (bonus included)

and a cycle of width T over B rows costs

    cost(B, T) = target(B, T) + (T > 1) * draft(B)      target(B, T) = t0 + t1 * B * T + t2 * B
                                                         draft(B)     = d0 + d1 * B

(t1: per token verified; t2: per row, whatever its width: reading the row's keys, which grows
with the context the costs were measured at). A GPU's verify cost is not linear in T: attention
kernels work in tiles of query rows (the H100's ``block_target_B64_T*`` in
docs/results/batched-h100-2026-11-23-qwen3-4b-profile-routes-widths.json). So the widths the
width policy chooses among are also timed at the job's batch size, and target(B, T) is read from
them: interpolated in T between timed widths and in B between that
batch size and the fitted line at B = 1 (a job of one row reads its own timed widths).

The width policy picks T among the bucket widths (below) maximising

    sum_b E_b(min(T, budget_b)) / cost(B, T)

T = 1 is plain batched decoding (no draft pass). An engine's first job starts from a neutral
p_1 = 0.5, so from the width the cost model justifies for a drafter of unknown worth (on a CPU: plain
decoding); later jobs start from the estimates pooled over the jobs before them, and each row
from the pooled estimates. A position never verified takes the estimate of the
one before it, so blocks widen as runs of accepted drafts show that wider ones pay.

The job's tail. Tokens per second over the live rows is the right objective while requests wait to
take the slots that rows free. Once none can join (the decoder says so, and passes each row's
tokens left n_b), the job ends when its slowest row does, and drafting makes rows finish raggedly:
a row's commits per cycle are random, and rows differ. Where a cycle of a few rows costs about
what one of the whole batch does (a launch-bound GPU), plain decoding's max(n_b) cycles can beat
drafting at a better rate. The same holds in a job's last wave, where every request still waiting
will take a slot that a live row frees: the job ends when the slowest slot has decoded its row and
the request it takes, so the decoder passes, as each row's n_b, its tokens left and, for the rows
that will finish first, the budget of the request each takes (``BatchDecoder._tail``), where most
rows run to their budgets (``finish.Ends``): where most stop early at EOS, the slot that ends last
is the one whose answers run longest, which no width changes, and the budgets the decoder would
pass overstate by a second answer what each slot has left, so a last wave of such rows is weighed
by the rate. So at the tail the width policy picks the T that finishes every row soonest were
every remaining cycle run at T (re-decided each cycle). At width T row b commits X_b a cycle, L =
min(T, budget_b), with S_j = P(X_b >= j) = p_b1 ... p_b(j-1), mean mu_b = E_b(L) and variance v_b
= sum_{j <= L} (2j - 1) S_j - mu_b^2; it finishes after about n_b / mu_b cycles, with a spread of
sqrt(n_b v_b / mu_b^3) (a renewal count), taken as normal. The last row finishes at the expected
maximum of these, by Clark's fold (the max of two normals taken as a normal of its own mean and
variance, maxed with the next: exact for two rows, right for one row far behind the rest, which
alone decides the end, and within 1% of the expected maximum of 32 rows alike). The others finish,
ranked by their means, at the mean plus the spread times Blom's expected order statistics of B
normals, z_k = inv_cdf((k - 0.375) / (B + 0.25)), capped at the last. Between two finishes each
cycle costs cost(rows still live, T), and a width not yet run adds K once (below). T = 1 is exact:
n_b cycles. One row (z = 0) gets the rate's choice: n / E(T) cycles at cost(1, T), and K once, is
n over the rate weighed below. Within the tail, rows that stop early (EOS) are not foreseen. A
drafting probe (below) at a batch's tail brings its end closer only through its slowest row, so
once the engine has drafted, probes there run at the least share (probe_share / backoff).

Which widths. On a GPU a pass of a shape not run before compiles (its trace, its kernels) at
many times a pass's cost, so a job must run few shapes, the same ones job after job, and the
warm-up times (and so compiles) widths of this set (engine/warmup.py). Every verify pass runs at
a bucket width (``buckets``): WIDTHS below the block, and the block. Near the end of the rows'
budgets their limits min(T, budget_b) would make a pass of any width; instead the width policy
offers the buckets below the longest budget and the smallest bucket that holds it (never above
the block), each costed as its own pass, cost(B, T), and committing sum_b E_b(min(T, budget_b))
as above: a row never commits past its budget, and its pass positions past its limit are
verified and discarded, as a short-budget row's beside a long one's always were. The decoder
runs the pass at the bucket that holds the rows' limits (engine/batch.py: ``run``).

Rows in plain decoding learn nothing about their drafts, so they are probed at a small width
once the plain cycles since the last drafting cycle have cost 20 times what a probe can lose (a
probe commits at least the bonus token, as a plain cycle does, so it loses at most
cost(B, probe) - cost(B, 1)); before the engine has drafted at all, the plain cycles the job's
longest budget still allows count as spent, so a long first job probes at its start. Rows whose
longest budget is below the probe's width are not probed: what the probe would learn could not be
drafted on before they end, and its pass, narrower than any other, is a shape to compile on a GPU
(the plain cycles count on, for the next job's rows). Each probe after the
first that leaves the width policy still not drafting halves that share (to 1/8 of it at most): a
drafter that keeps failing is tried ever more rarely (the README's job on a 2-core CPU, whose
drafts are accepted about 15% of the time, is such a case), and a cycle in which most rows that
verified drafts accepted every one, or a drafting cycle the width policy chooses on its own,
restores the share (``_restore_probes``). What the drafting probes spent (the plain cycles
since the last drafting cycle, the probes since the last restore) is the engine's, kept from job
to job (``DraftingProbes``), as the plain probes' is: a job too short for a probe of its own adds
its plain cycles to the next one's, and a drafter whose probes failed in the jobs before is tried
as rarely in the next, where a count begun afresh every job would pay the whole share's first
probes in each (a long-running worker's short jobs then each paid one or two). So the bounds hold
over the engine's run of plain decoding, across its jobs, not job by job (one job may probe for
the plain cycles of the jobs before it): a drafter that always fails makes that run at most
about 5% slower, and a long one under 1% (tests/test_widths.py counts them; for a first job
whose rows end well before their budgets, the first probe can cost more than 5% of it).

Drafting learns nothing about plain cycles either, and the width-1 cost is learnt only from
plain cycles that run: a width-1 pass timed in a load spike at warm-up (a CPU's timings) would
price plain decoding too dear, the width policy would draft on every cycle, and nothing would
correct it. So, symmetrically, a drafting cycle of width T chosen over B rows, committing
E = sum_b E_b(min(T, budget_b)) on average, is replaced by a plain probe once the drafting
cycles since the last plain cycle have cost 1 / probe_share times what the probe can lose. A
plain probe commits B tokens (the bonus of each row) where the drafting cycle commits E; taking
the E - B it does not commit at the drafting cycle's price per token, it loses at most

    cost(B, T) * (E - B) / E

(exactly cost(B, 1) - cost(B, T) * B / E, no more than that where a plain cycle costs no more
than a drafting one), a bound read from the drafting widths' costs, which their own cycles keep
honest, not from the width-1 cost under suspicion. The first TRUSTED plain probes run at the
whole share (a kind's learnt excess counts from its TRUSTED-th cycle); each later one that leaves
the width policy drafting halves the share, to 1/8 of it at most, and a plain cycle the width policy
chooses on its own restores it. What the probes spent is the engine's, kept from job to job
(``PlainProbes``): a job too short for a probe of its own adds its drafting to the next one's,
so the width-1 cost is measured again however short the jobs. Over any run of drafting the
plain probes lose at most probe_share of the drafting cycles' cost (5%), and over a long one
little more than 1/8 of that (tests/test_plain_probes.py counts them). A cost model that learns
nothing from cycles (``window`` 0) is not probed.

What a new shape costs. A pass of a shape (rows, width) the process has not run compiles on a
GPU, at many times a cycle's cost; on the CPU an eager pass compiles nothing. The decoder keeps
such cycles out of what the cost model learns and records their excess over the modelled
cycle instead (``CompileCost``: K, the mean of the recorded excesses and, on a GPU only, a
prior worth one of them). A width whose pass at the batch's rows has not run (nor been timed at
warm-up) is charged K once, spread over the cycles the job has left at it: with S = sum_b
budget_b still allowed and E(T) committed a cycle, about S / E(T) cycles, so it is weighed at

    E(T) / (cost(B, T) + K * min(1, E(T) / S))

S / E(T) overstates the cycles left where rows end early (EOS) or the batch shrinks, and the
compiled pass serves the process's later jobs too: the two errors pull opposite ways, and a
simpler rule has no better claim. Where K is 0 (a CPU's eager passes) the choice is the one above.
A probe must not compile either: its bound is a few plain cycles' worth, and a compile of a large
target's pass costs many jobs' probes. So where K is not 0 and the probe's width would be a new
shape, the probe runs at the narrowest drafting width that has run or was timed at the batch's
rows (the warm-up's widths: engine/warmup.py), and where there is none, what it can lose includes
K. The batch's tail shrink is weighed likewise (engine/batch.py: ``BatchDecoder.shrink``):
dropping to a rung of R rows from S_rows saves target(S_rows, T) - target(R, T) a cycle at the
width last run, for about the live rows' mean budget in cycles, and goes ahead only where that
covers K for a (R, T) not yet run (a launch-bound model on a GPU saves next to nothing).

A plain cycle with a drafter attached must cost what it costs without one. The widths are not
weighed again while a plain choice stands and nothing is learnt (no row joins or leaves, no
cycle verifies a draft), for up to REPLAN cycles (what cycles cost beyond their passes drifts):
in a plain cycle the estimates stay where they are and the budgets only fall, which never makes
a wider cycle pay better, so the choice is the one the full weighing would make. At the tail
too: drafting saves cycles in proportion to the budgets, its spread falls only as their square
root and the compile charge not at all.

A draft tree (engine/tree.py) is worth more per width than a chain, since its branches repair
first misses: a tree cycle chooses its width again once the drafts are known, from the nodes'
own scores corrected per depth by what tree cycles accepted (``WidthPolicy.tree_width``,
``NodeCalibration``). Whether to draft at all stays the chain model's choice above. A probe's
tree is drafted and verified no wider than the probe (its bound is what it can lose at that
width; a sure drafter's wrong tree would otherwise take the whole block), and its cycle, whose
drafter pass ran the probe's positions alone, is not what a tree cycle of its width costs: the
cost model learns nothing from it.

The pass costs come from timing real passes at warm-up, at the job's batch size and typical
context (``Engine.warm_up``, engine/warmup.py); what a cycle costs beyond its passes is learnt
from every cycle the engine times.

Borrowed excess. What a cycle costs beyond its passes has two parts: host work, about the same
every cycle, and, while other work loads the machine, a stretch of every pass in proportion to
its cost. A width with too few cycles of its own at the batch's rung borrows its kind's learnt
excess, and drafting, until it has TRUSTED cycles of its own, the plain kind's (``CostModel``).
Borrowed as seconds, the excess prices the host work right and the stretch at the lender's
passes: a drafting cycle, a target pass at width T and a drafter pass, several plain cycles'
cost on a CPU, was charged a plain cycle's stretch, so under load drafting looked cheaper than
it was and the width policy drafted where it did not pay. Borrowed relative to the lender's
passes and scaled by the borrower's own, it prices the stretch right and the host work in
proportion. A drafting width is charged the greater of the two, never below what the two parts
come to, whatever their mix: where its passes are dearer than the lender's the relative reading
holds it (overpricing only the host work), where cheaper the seconds do (overpricing only the
stretch). The same holds where the drafting kind lends to its own widths: its excess is learnt
from the widths timed, and a wider width's passes are dearer, so its stretch is larger.
Overpricing drafting is the safe way: the width policy then decodes plainly, which is the
baseline; the drafting probes still run, and a width that runs is costed from its own cycles
after TRUSTED of them. The plain kind keeps its seconds: a plain cycle priced dearer would make
drafting look cheaper.

Stale tables. Those timings are kept in the model cache for later processes
(engine/cost_tables.py), and timings only err high: a table timed while other work loaded the
machine prices every pass too dear for every process that reads it. So a process checks the
table it read against its own cycles (``CostModel.stale``): where the median of its last cycles
ran more than STALE below their modelled passes, the next job times the passes again (once per
table and process: ``Engine._measured_cost``). Every cycle counts, plain or drafting, at any
width and any number of rows, so a job that drafts only at widths the table does not time still
checks it. A cycle at a timed width over the table's own rows is held to a timing; anywhere else
its passes are read off lines between timed points, which err both ways (a GPU's tiles of query
rows; a batch's cost is not a line in its rows), so such a cycle is held to its modelled passes
less INTERPOLATION of them. Why this is safe: where an honest table's lines overprice a pass by
INTERPOLATION, its cycles count as right on their passes, still STALE short of marking it, so an
honest table is not timed again process after process (and timing one again keeps the faster
timings: cost_tables.py); a table priced too dear throughout is caught whatever widths the job
runs, and where it runs none of the timed ones, once the table prices them above
1 / ((1 - STALE) (1 - INTERPOLATION)) times what they cost.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import finish

NEUTRAL_P = 0.5  # a draft position's acceptance before anything is known of it


class Acceptance:
    """Acceptance estimates per draft position k = 1..positions: decayed counts of the cycles
    that verified draft k (its first k - 1 accepted) and of those that accepted it, each over a
    prior worth ``prior_weight`` cycles.

    A cycle that verified L rows and accepted a drafts saw drafts 1..a accepted and, if
    a < L - 1, draft a + 1 rejected; it says nothing of the drafts after that.
    """

    def __init__(self, positions: int = 15, decay: float = 0.9, prior_weight: float = 2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.seen = [0.0] * positions  # seen[k - 1]: cycles that verified draft k
        self.kept = [0.0] * positions  # kept[k - 1]: ... and accepted it
        self.updates = 0  # cycles that taught it something (verified a draft)

    def update(self, accepted: int, verified: int) -> None:
        if verified <= 1:
            return
        d = self.decay
        seen = min(accepted + 1, verified - 1, len(self.seen))  # drafts 1..a, and a + 1 if verified
        kept = min(accepted, seen)  # drafts 1..a
        self.seen = [d * n + 1.0 for n in self.seen[:seen]] + [d * n for n in self.seen[seen:]]
        self.kept = [d * n + 1.0 for n in self.kept[:kept]] + [d * n for n in self.kept[kept:]]
        self.updates += 1

    def probabilities(self, prior: Optional[Sequence[float]] = None) -> List[float]:
        """[p_1, ..., p_positions], p_k = P(draft k accepted | drafts 1..k-1 accepted). Position
        k's prior is ``prior[k - 1]`` (say, the job's estimate); without one, the estimate of
        position k - 1 (a drafter right k - 1 times running is taken to be as good at draft k
        until shown otherwise), and NEUTRAL_P for position 1."""
        w, out = self.prior_weight, []
        for k, (seen, kept) in enumerate(zip(self.seen, self.kept)):
            base = prior[k] if prior is not None else (out[-1] if out else NEUTRAL_P)
            out.append((kept + w * base) / (seen + w))
        return out


def expected_committed(p: Sequence[float], top: int) -> List[float]:
    """[E(0), E(1), ..., E(top)]: tokens committed on average by verifying L rows,
    E(L) = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_(L-1) (E(0) = 0: nothing verified)."""
    out, run = [0.0], 1.0
    for L in range(1, top + 1):
        out.append(out[-1] + run)
        run *= p[L - 1] if L - 1 < len(p) else 0.0
    return out


def pooled_acceptance(block: int) -> Acceptance:
    """Acceptance pooled over many rows' cycles (a job's, or an engine's jobs'): slowly decayed,
    a weak prior."""
    return Acceptance(max(block - 1, 0), decay=0.98, prior_weight=1.0)


class NodeCalibration:
    """How far to trust the drafter's own estimate of a draft tree's nodes (engine/tree.py): a
    node at depth d of score s (the sum of log q_k along its prefix) is accepted with probability

        P(node) = c_d * exp(s)      c_d = (accepted_d + w) / (predicted_d + w)

    where, over the decayed tree cycles so far, predicted_d sums exp(s) over the nodes verified at
    depth d and accepted_d counts the cycles whose walk reached depth d (at most one node of a
    depth is on the path). exp(s) multiplies marginals as if the positions were independent, and
    a drafter is surer or less sure than it is right; c_d corrects both, per depth, from a prior
    of 1 worth w."""

    def __init__(self, depths: int = 15, decay: float = 0.98, prior_weight: float = 1.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.predicted = [0.0] * depths
        self.accepted = [0.0] * depths

    def update(self, predicted: Sequence[float], accepted: int) -> None:
        """One row's tree cycle: ``predicted[d - 1]`` = sum of exp(s) over its nodes at depth d,
        and the drafts it accepted."""
        d = self.decay
        for k in range(len(self.predicted)):
            self.predicted[k] = d * self.predicted[k] + (
                predicted[k] if k < len(predicted) else 0.0
            )
            self.accepted[k] = d * self.accepted[k] + (1.0 if k < accepted else 0.0)

    def scales(self) -> List[float]:
        w = self.prior_weight
        return [(a + w) / (p + w) for a, p in zip(self.accepted, self.predicted)]


@dataclass
class DraftingProbes:
    """What the drafting probes have spent (module doc). The engine keeps one from job to job,
    as it keeps ``PlainProbes``: a drafter whose probes failed in the jobs before is tried as
    rarely in the next one, where a count begun afresh every job would pay the whole share's
    first probes again in each (a long-running worker's jobs each paid one or two)."""

    plain: float = 0.0  # seconds of plain cycles since the last drafting cycle
    failed: int = 0  # drafting probes since the width policy last chose to draft on its own


@dataclass
class PlainProbes:
    """What the plain probes have spent (module doc). The engine keeps one from job to job, as
    it keeps the pooled acceptance: at batch 1 every request is a job of its own, and one that
    began at the whole share every time would pay it on every request."""

    drafting: float = 0.0  # seconds of drafting cycles since the last plain cycle
    failed: int = 0  # plain probes since the width policy last chose a plain cycle itself


@dataclass
class CompileCost:
    """K: what a pass shape's first cycle in a process costs beyond the modelled cycle (module
    doc), the mean of the last ``window`` such excesses recorded and the prior, worth one of
    them. The engine keeps one from job to job: a GPU's starts from COMPILE_PRIOR, a CPU's from 0
    and, where its passes run eagerly (nothing compiles), learns nothing (``learns``)."""

    prior: float = 0.0
    learns: bool = True
    window: int = 16
    seen: List[float] = field(default_factory=list)

    def observe(self, excess: float) -> None:
        if self.learns:
            self.seen.append(max(excess, 0.0))
            del self.seen[: -self.window]

    def estimate(self) -> float:
        if not self.prior:
            return _mean(self.seen)
        return (self.prior + sum(self.seen)) / (1 + len(self.seen))


# seconds: a GPU pass shape's first cycle beyond its cost (docs/results/new-shapes-2026-11-28.md)
COMPILE_PRIOR = 0.05
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TRUSTED = 3  # cycles of a kind before its learnt overhead is used
STALE = 0.25  # cycles this much below their timed passes: the timings were spiked (stale)
# how far below its passes as read between timed widths and rows an honest table's cycle may run
INTERPOLATION = 0.15
PROBE_WIDTH = 4  # rows a probe verifies: a drafter of unknown worth is tried at this width
# plain cycles a plain choice stands while nothing is learnt, before it is weighed again
REPLAN = 16


def buckets(block: int) -> List[int]:
    """The verify widths a pass ever runs at (module doc): WIDTHS below the block, and the block.
    The widths the warm-up times (and so compiles) are among them (engine/warmup.py)."""
    return sorted({w for w in WIDTHS if w < block} | {max(block, 1)})


def bucket(width: int, block: int) -> int:
    """The smallest bucket width that holds ``width`` rows (``width`` itself past the block)."""
    return next((w for w in buckets(block) if w >= width), width)


def batch_rung(rows: int) -> int:
    """The batch size a batch of ``rows`` live rows shrinks to: the smallest of 1, 2, 3, 4, 6, 8,
    12, 16, 24, ... (powers of two and one and a half times them) that holds them."""
    power = 1
    while power < rows:
        power *= 2
    between = 3 * power // 4  # one and a half times the power of two below
    return between if power >= 4 and between >= rows else power


@dataclass
class CostModel:
    """Seconds per cycle: target(B, T) = t0 + t1 * B * T + t2 * B, draft(B) = d0 + d1 * B
    (measured at warm-up), plus what a cycle costs beyond its passes (host work, scatter, sync),
    learnt from the cycles the engine times: the median excess of the last ``window`` cycles of
    each kind (plain, drafting), so that a cycle slowed by a one-off compilation does not steer
    the rest; and, once a width has run TRUSTED cycles at a batch size's rung (``batch_rung``:
    the batch size the batch shrinks to, so the pass shape its cycles ran at), the median excess
    of that width's own. The rung, not the live rows: rows finish one by one, and a shrinking
    batch rarely runs TRUSTED cycles at one live-row count, so a width costed per count kept the
    price the line gave it for a whole job (the default pair on a GPU at batch 32 drafted most of
    a job at a width dearer per token than plain decoding: tests/test_widths.py replays it).
    Widths read between timed ones can be far off: on a 2-core CPU (OpenBLAS) the default pair's
    pass at T = 12 cost more than at T = 16, where the line through the timed
    T = 4 and 16 put it below, so the width policy kept choosing 12. A width that costs more than
    modelled is chosen, runs and is then costed as it ran. Its cycles do not count in its kind's
    excess (where widths have been timed, only theirs do): that would make the widths not yet
    run look dear, and they would never run to show otherwise. A warm-up at another context
    keeps what the widths learnt (``Engine.warm_up``). A drafting width that borrows its kind's
    excess, or the plain kind's, is charged at least that excess relative to the lender's
    passes, scaled by its own (module doc, "Borrowed excess")."""

    t0: float = 1.0
    t1: float = 0.0
    d0: float = 0.0
    d1: float = 0.0
    t2: float = 0.0
    window: int = 16  # cycles per kind in the running median (0: the passes alone)
    excess: Dict[bool, List[float]] = field(default_factory=lambda: {False: [], True: []})
    # (batch_rung(B), T) -> the last cycles' excess
    width_excess: Dict[Tuple[int, int], List[float]] = field(default_factory=dict)
    context: Optional[int] = None  # tokens per row the passes were timed at (None: any)
    # the ragged attention route chosen with them (engine/ops/attention.py)
    route: Optional[str] = None
    # the few-row matmul mode chosen with them (engine/ops/matmul.py; None: the engine's own)
    matmul: Optional[str] = None
    rows: int = 0  # the batch size of ``timed`` (0: none timed)
    # T -> seconds of a target pass at ``rows``
    timed: Dict[int, float] = field(default_factory=dict)
    # read from the model cache (engine/cost_tables.py), not timed by this process
    read: bool = False
    # the last cycles' excess over their modelled passes (less INTERPOLATION of them where
    # those were read between timed points), relative to them
    relative: List[float] = field(default_factory=list)
    # the cycles of ``excess``, each one's excess relative to its modelled passes
    stretch: Dict[bool, List[float]] = field(default_factory=lambda: {False: [], True: []})

    def stale(self) -> bool:
        """Whether the passes as timed are dearer than this process's cycles show (module doc,
        "Stale tables"): the median of its last cycles (TRUSTED at least, plain or drafting, at
        any width and rows) ran below their modelled passes, less INTERPOLATION of them where
        those were read between timed points, by more than STALE of them."""
        return len(self.relative) >= TRUSTED and _median(self.relative) < -STALE

    def target(self, B: int, T: int) -> float:
        line = self.t0 + self.t1 * B * T + self.t2 * B
        if not self.timed or (self.rows < 2 and B != self.rows):
            return line
        at_rows = _interpolate(self.timed, T)
        if self.rows < 2:  # timed at batch 1 itself
            return max(at_rows, 1e-9)
        at_one = self.line(T)
        return max(at_one + (at_rows - at_one) * (B - 1) / (self.rows - 1), 1e-9)

    def line(self, T: int) -> float:
        """The fitted target pass of T rows at batch 1 (what ``target`` reads between it and the
        widths timed at ``rows``)."""
        return self.t0 + self.t1 * T + self.t2

    def passes(self, B: int, T: int) -> float:
        return self.target(B, T) + (self.d0 + self.d1 * B if T > 1 else 0.0)

    def _lender(self, drafting: bool) -> Optional[bool]:
        """The kind whose learnt excess a cycle of this kind borrows: its own once it has TRUSTED
        cycles; until then, for drafting, the plain kind's (a job that drafts rarely must not let
        one slow drafting cycle, such as the first of a process, keep it from drafting); None
        where neither has."""
        if len(self.excess[drafting]) >= TRUSTED:
            return drafting
        return False if drafting and len(self.excess[False]) >= TRUSTED else None

    def overhead(self, drafting: bool) -> float:
        """The median excess, in seconds, of the kind this kind borrows from (``_lender``)."""
        kind = self._lender(drafting)
        return 0.0 if kind is None else _median(self.excess[kind])

    def stretched(self, drafting: bool) -> float:
        """The median excess of the kind this kind borrows from, relative to those cycles'
        modelled passes."""
        kind = self._lender(drafting)
        return 0.0 if kind is None else _median(self.stretch[kind])

    def cycle(self, B: int, T: int) -> float:
        passes = self.passes(B, T)
        own = self.width_excess.get((batch_rung(B), T), ())
        if len(own) >= TRUSTED:
            excess = _median(own)
        elif T > 1:
            # borrowed by a drafting width: the greater of its seconds and its share of the
            # passes (module doc, "Borrowed excess"); the plain kind keeps its seconds
            excess = max(self.overhead(True), self.stretched(True) * passes)
        else:
            excess = self.overhead(False)
        return max(passes + excess, 1e-9)

    def observe(self, B: int, T: int, seconds: float) -> None:
        if not self.window:
            return
        passes = self.passes(B, T)
        excess = seconds - passes
        if T in self.timed or not self.timed:
            self._keep(self.excess[T > 1], excess)
            self._keep(self.stretch[T > 1], excess / max(passes, 1e-9))
        self._keep(self.width_excess.setdefault((batch_rung(B), T), []), excess)
        # timed at these rows and this width, or read between timed points (``stale``)
        measured = not self.timed or (T in self.timed and B == self.rows)
        floor = passes if measured else (1 - INTERPOLATION) * passes
        self._keep(self.relative, seconds / max(floor, 1e-9) - 1)

    def _keep(self, seen: List[float], value: float) -> None:
        """Append to one of the running windows, keeping its last ``window``."""
        seen.append(value)
        del seen[: -self.window]

    @classmethod
    def fit(
        cls, target_times: Dict[Tuple[int, int], float], draft_times: Dict[int, float]
    ) -> "CostModel":
        """Non-negative least squares of target(B, T) over measured (B, T) -> seconds, and of the
        line draft(B) over B -> seconds."""
        t0, t1, t2 = _fit([((1.0, B * T, B), s) for (B, T), s in target_times.items()])
        d0, d1 = (
            _fit([((1.0, B), s) for B, s in draft_times.items()]) if draft_times else (0.0, 0.0)
        )
        return cls(t0=max(t0, 1e-9), t1=t1, d0=d0, d1=d1, t2=t2)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _median(values: Sequence[float]) -> float:
    """The upper median (the middle of an odd count)."""
    return sorted(values)[len(values) // 2]


def _interpolate(points: Dict[int, float], x: int) -> float:
    """Piecewise-linear through ``points`` (x -> y), extended by the nearest segment's slope."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def _fit(points: List[Tuple[Tuple[float, ...], float]]) -> List[float]:
    """Coefficients c >= 0 minimising sum (c . x - y)^2 over points (x, y); the first feature is the
    constant. Features a least-squares fit would weigh below 0 (or that the points cannot tell
    apart from the others) are dropped one at a time, the last first, and the rest refitted."""
    n = len(points[0][0])
    used = list(range(n))
    while True:
        c = _solve(points, used)
        if c is not None and all(v >= 0 for v in c):
            out = [0.0] * n
            for i, v in zip(used, c):
                out[i] = v
            return out
        if len(used) == 1:  # the constant alone: the mean
            return [sum(y for _, y in points) / len(points)] + [0.0] * (n - 1)
        negative = [i for i, v in zip(used, c or [-1.0] * len(used)) if v < 0 and i != 0]
        used.remove(negative[-1] if negative else used[-1])


def _solve(points, used: List[int]) -> Optional[List[float]]:
    """Least squares on the features ``used`` (normal equations, Gaussian elimination); None if
    the points do not determine them."""
    k = len(used)
    a = [
        [sum(x[i] * x[j] for x, _ in points) for j in used] + [sum(x[i] * y for x, y in points)]
        for i in used
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row[:k])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * w for u, w in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]


class WidthPolicy:
    """Chooses each cycle's verify width (see module doc). ``fixed`` verifies the whole block
    every cycle (the cost model is not consulted).

    ``job`` pools every row's cycles and is each row's prior, read afresh every cycle: a row that
    joins starts from what the job knows, and a drafter that fails on this job's text is not
    tried afresh on every new row. The engine passes its own (``pooled_acceptance``), kept from
    job to job: a job starts from what the jobs before it learnt of the drafter, not from
    NEUTRAL_P (at batch 1 every request is a job of its own, and a first draft rejected would
    otherwise send it to plain decoding).
    """

    def __init__(
        self,
        block: int,
        cost: CostModel,
        fixed: bool = False,
        probe_share: float = 0.05,
        probe_width: int = PROBE_WIDTH,
        backoff: int = 8,
        job: Optional[Acceptance] = None,
        nodes: Optional[NodeCalibration] = None,
        plain: Optional[PlainProbes] = None,
        compile: Optional[CompileCost] = None,
        drafting: Optional[DraftingProbes] = None,
    ):
        self.block, self.cost, self.fixed = block, cost, fixed
        self.compile = compile if compile is not None else CompileCost(learns=False)  # the engine's
        # whether a pass of width T at the batch's rows would be the process's first (the decoder's)
        self.new_shape: Callable[[int], bool] = lambda T: False
        self.probe_share, self.probe_width = probe_share, min(probe_width, block)
        self.backoff = backoff  # the most a run of failed probes divides the probe share by
        # what the drafting probes spent: the engine's, from job to job
        self.drafting = drafting if drafting is not None else DraftingProbes()
        # rows of the last cycle that verified drafts, and those that accepted every one
        self.cycle_rows = self.cycle_right = 0
        self.job = job if job is not None else pooled_acceptance(block)  # every row's cycles
        self.plain = plain if plain is not None else PlainProbes()  # the engine's, from job to job
        # draft trees' nodes
        self.nodes = nodes if nodes is not None else NodeCalibration(max(block - 1, 0))
        # what the last plain choice was made from (the job's and the rows' estimates), and the
        # cycles it has stood: ``width`` does not weigh the widths again while nothing is learnt
        self.plain_from: Optional[Tuple[int, Tuple[int, ...]]] = None
        self.plain_cycles = 0
        # the width of the drafting probe the last ``width`` chose (0: none): a tree probe drafts
        # and verifies no wider, and its cycle is not what a drafting cycle costs (module doc)
        self.probe = 0

    def widths(self, longest: int) -> List[int]:
        """The widths worth choosing among (module doc): the buckets below ``longest`` and the
        smallest one that holds it (the pass a cycle for the longest budget runs at)."""
        top = bucket(min(self.block, longest), self.block)
        return [w for w in buckets(self.block) if w <= top]

    def new_row(self) -> Acceptance:
        return Acceptance(max(self.block - 1, 0))

    def accepted(self, row: Acceptance, accepted: int, verified: int) -> None:
        row.update(accepted, verified)
        self.job.update(accepted, verified)
        if verified > 1:  # read by the next ``width`` (``_restore_probes``)
            self.cycle_rows += 1
            self.cycle_right += accepted == verified - 1

    def _restore_probes(self) -> None:
        """After a cycle in which most rows that verified drafts accepted every one, the drafter
        may be turning good: probe at the whole share again. Most, not any: in a wide batch some
        row gets a short probe all right by chance (at 32 rows and p = 0.45 nearly every probe
        has one), and the probes would never back off."""
        if self.cycle_rows and 2 * self.cycle_right > self.cycle_rows:
            self.drafting.failed = 0
        self.cycle_rows = self.cycle_right = 0

    def width(
        self,
        estimates: Sequence[Acceptance],
        budgets: Sequence[int],
        tail: Optional[Sequence[int]] = None,
    ) -> int:
        """The verify width for the next cycle over rows with these estimates and cycle budgets
        (the most a cycle may commit to each row). ``tail``: no request can join the batch (the
        job's tail), and these are the tokens each row has left; the width is then the one that
        finishes every row soonest, not the one of most tokens per second (module doc)."""
        self._restore_probes()
        self.probe = 0
        longest = max(budgets)
        if self.block < 2 or longest < 2:
            self.plain.drafting = 0.0  # a plain cycle runs, as a plain probe would
            return 1
        if self.fixed:
            return bucket(min(self.block, longest), self.block)
        B = len(budgets)
        # a row joined or left, a draft was verified, or the job's tail began
        learnt = (self.job.updates, tuple(map(id, estimates)), tail is not None)
        if learnt == self.plain_from and self.plain_cycles < REPLAN:
            self.plain_cycles += 1  # still plain (module doc: what a plain cycle does not change)
        else:
            best, tokens = self._best_width(estimates, budgets, longest, tail)
            if best > 1:
                self.drafting.plain, self.drafting.failed, self.plain_from = 0.0, 0, None
                return 1 if self._plain_probe(B, best, tokens) else best
            self.plain_from, self.plain_cycles = learnt, 0
            self.plain.drafting, self.plain.failed = 0.0, 0
        # Plain decoding learns nothing about the drafts: probe once the plain cycles since the
        # last drafting cycle have cost 1 / probe_share times what a probe can lose (it commits
        # at least the bonus token, as the plain cycle it replaces does). Before the engine has
        # drafted at all, the plain cycles ahead count too (at most the longest budget's), so a
        # long job learns its drafter's worth at once and a short one does not pay to. Each probe
        # that did not lead to drafting halves the share (module doc); at a batch's tail, once
        # the engine has drafted, it is the least share (module doc, "The job's tail").
        plain, spent = self.cost.cycle(B, 1), self.drafting
        spent.plain += plain
        if longest < self.probe_width:  # the rows end before a probe could pay (module doc)
            return 1
        probe = self._probe_width(longest)
        ahead = (longest - 1) * plain if self.job.seen[0] == 0 else 0.0
        least = tail is not None and B > 1 and not ahead
        halved = self.backoff if least else min(2 ** max(spent.failed - 1, 0), self.backoff)
        share = self.probe_share / halved
        # what the probe can lose: its cycle over a plain one, and its compile where it is new
        compile = self.compile.estimate() if self.new_shape(probe) else 0.0
        if (spent.plain + ahead) * share >= self.cost.cycle(B, probe) - plain + compile:
            spent.plain = 0.0
            spent.failed += 1  # until a cycle drafts by choice (above)
            self.probe = probe
            return probe
        return 1

    def _probe_width(self, longest: int) -> int:
        """A probe's width (module doc, "What a new shape costs"): PROBE_WIDTH, or where a
        pass of a new shape compiles and that one would be new, the narrowest drafting width
        whose pass has run or been timed at the batch's rows (none: PROBE_WIDTH, its compile
        counted in what the probe can lose)."""
        probe = bucket(min(self.probe_width, longest), self.block)
        if not self.compile.estimate() or not self.new_shape(probe):
            return probe
        ready = [w for w in self.widths(longest) if w > 1 and not self.new_shape(w)]
        return ready[0] if ready else probe

    def _best_width(
        self,
        estimates: Sequence[Acceptance],
        budgets: Sequence[int],
        longest: int,
        tail: Optional[Sequence[int]] = None,
    ) -> Tuple[int, float]:
        """The width of most tokens per second by the cost model (1: plain decoding), or at the
        job's tail the one that finishes every row soonest, and the tokens it commits on average.
        One row's time to finish, n / E(T) cycles of cost(1, T) and K once, is its budget over
        the rate weighed here (K over n / E(T) cycles): the same choice, so it takes this path."""
        B = len(budgets)
        widths = self.widths(longest)
        committed = _committed(estimates, budgets, self.job.probabilities(), widths)
        compile, allowed = self.compile.estimate(), sum(budgets)
        if tail is not None and B > 1:
            best = self._soonest(estimates, budgets, tail, widths)
            return best, committed[widths.index(best)]
        best, best_tokens, best_rate = 1, float(B), -1.0
        for T, tokens in zip(widths, committed):
            # a shape not yet run: K over the about allowed / tokens cycles left at it (module doc)
            first = compile * min(1.0, tokens / allowed) if compile and self.new_shape(T) else 0.0
            rate = tokens / (self.cost.cycle(B, T) + first)
            if rate > best_rate * (1 + 1e-9):
                best, best_tokens, best_rate = T, tokens, rate
        return best, best_tokens

    def _soonest(
        self,
        estimates: Sequence[Acceptance],
        budgets: Sequence[int],
        left: Sequence[int],
        widths: List[int],
    ) -> int:
        """The width whose cycles, every one run at it, finish all the rows soonest by the cost
        model (module doc, "The job's tail"), a width not yet run charged its compile once."""
        z, compile = finish.order_statistics(len(left)), self.compile.estimate()
        moments = finish.moments(estimates, budgets, self.job.probabilities(), widths)
        best, best_time = 1, math.inf
        for T, rows in zip(widths, moments):
            cycle = functools.partial(self.cost.cycle, T=T)
            time = finish.finish_time(cycle, T, rows, budgets, left, z)
            time += compile if compile and self.new_shape(T) else 0.0
            if time < best_time * (1 - 1e-9):
                best, best_time = T, time
        return best

    def _plain_probe(self, B: int, T: int, tokens: float) -> bool:
        """Whether to run a plain cycle in place of the drafting cycle of width T chosen, which
        commits ``tokens`` on average: the width-1 cost is learnt only from plain cycles that run,
        and one priced too dear (a warm-up pass timed in a load spike) would otherwise keep the
        width policy drafting for good. A plain probe commits one token per row where the drafting
        cycle commits ``tokens``; at the drafting cycle's price per token it loses at most the
        extra tokens' worth (module doc), a figure from the drafting cycles' costs, not from the
        width-1 cost under suspicion. It runs once the drafting cycles since the last plain one
        have cost 1 / probe_share times that, the share halved per probe that left the width policy
        drafting, as for the drafting probes, once the first TRUSTED have run at the whole share
        (the cost model trusts a kind's cycles from its TRUSTED-th on), to 1 / backoff of it. A
        cost model that learns nothing from cycles (``window`` 0) is not probed."""
        if not self.cost.window:
            return False
        spent, drafting = self.plain, self.cost.cycle(B, T)
        loss = drafting * max(tokens - B, 0.0) / tokens
        share = self.probe_share / min(2 ** max(spent.failed - TRUSTED + 1, 0), self.backoff)
        if spent.drafting > 0 and spent.drafting * share >= loss:
            spent.drafting = 0.0
            spent.failed += 1  # until the width policy chooses a plain cycle on its own
            return True
        spent.drafting += drafting
        return False

    def tree_width(
        self, trees: Sequence[Tuple[Sequence[int], Sequence[float]]], budgets: Sequence[int]
    ) -> int:
        """The verify width of a tree cycle, chosen once the drafts are known: row b's trees are the
        first L_b - 1 of its best-first prefixes (``trees[b]``: their depths and scores, node 0
        the root), L_b = min(T, budget_b), and commit on average

            E_b(T) = 1 + sum over those nodes of c_depth * exp(score)      (NodeCalibration)

        The width maximises sum_b E_b(T) / cost(B, T) over the widths that draft (the draft pass is
        paid already)."""
        longest = max(budgets)
        if self.fixed or self.block < 2 or longest < 2:
            return bucket(min(self.block, longest), self.block)
        c = self.nodes.scales()
        widths = [T for T in self.widths(longest) if 1 < T <= (self.probe or self.block)]
        totals = [0.0] * len(widths)
        for (depths, scores), n in zip(trees, budgets):
            E = [1.0]  # E[j]: what a tree of the row's first j nodes commits
            for i in range(1, min(len(depths), n)):
                E.append(E[-1] + c[depths[i] - 1] * math.exp(scores[i]))
            for k, T in enumerate(widths):
                totals[k] += E[min(T, len(E)) - 1]
        B = len(budgets)
        best, best_rate = widths[0], -1.0
        for T, tokens in zip(widths, totals):
            rate = tokens / self.cost.cycle(B, T)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = T, rate
        return best

    def tree_accepted(self, depths: Sequence[int], scores: Sequence[float], accepted: int) -> None:
        """A row's tree cycle for the calibration: the nodes it verified (node 0 the root) and the
        drafts it accepted."""
        predicted = [0.0] * len(self.nodes.predicted)
        for d, s in zip(depths[1:], scores[1:]):
            if d - 1 < len(predicted):
                predicted[d - 1] += math.exp(s)
        self.nodes.update(predicted, accepted)


def _committed(
    estimates: Sequence[Acceptance], budgets: Sequence[int], job: Sequence[float], widths: List[int]
) -> List[float]:
    """Tokens the rows commit on average at each width T: sum_b E_b(min(T, budget_b)), with row
    b's p_bk = (kept_bk + w * job_k) / (seen_bk + w) (``Acceptance.probabilities(job)``).
    One pass per row over its positions, E_b(L) = sum_{i < L} prod_{j < i} p_bj, added to the
    widths' totals where a width reaches: O(rows x positions), no pass over the rows per width."""
    top = widths[-1]
    totals = [0.0] * len(widths)
    for e, n in zip(estimates, budgets):
        w, seen, kept = e.prior_weight, e.seen, e.kept
        reach = min(top, n)  # E_b(T) = E_b(reach) for every T >= reach
        at = 0  # the first width not yet credited
        E, run = 0.0, 1.0
        for L in range(1, reach + 1):
            E += run  # E(L)
            k = L - 1
            run *= (kept[k] + w * job[k]) / (seen[k] + w) if k < len(seen) else 0.0
            while widths[at] == L:  # widths are distinct and sorted
                totals[at] += E
                at += 1
                if at == len(widths):
                    break
            if at == len(widths):
                break
        for i in range(at, len(widths)):
            totals[i] += E  # widths past the row's reach commit E_b(reach)
    return totals
