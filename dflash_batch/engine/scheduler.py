"""How wide each cycle verifies: a cost model of target and drafter passes, and each row's
acceptance, choose the width T that commits the most tokens per second.

For row b with per-token acceptance p_b (a drafted token is accepted, given the ones before it
were, with probability p_b), verifying L rows commits on average

    E_b(L) = 1 + p_b + p_b^2 + ... + p_b^(L-1) = (1 - p_b^L) / (1 - p_b)      (bonus included)

and a cycle of width T over B rows costs

    cost(B, T) = target(B, T) + (T > 1) * draft(B)      target(B, T) = t0 + t1 * B * T
                                                         draft(B)     = d0 + d1 * B

The scheduler picks T in 1..block maximising  sum_b E_b(min(T, budget_b)) / cost(B, T).  T = 1 is
plain batched decoding (no draft pass), so when the estimates are right a cycle is never slower
than plain decoding at the same batch size. Rows in plain decoding learn nothing about their
drafts, so once plain cycles have cost 20 times a probe, one cycle drafts at a small width (a
probe adds at most 5% to the plain cycles around it).

The pass costs come from timing real passes at warm-up (``Engine.warm_up``); what a cycle costs
beyond its passes is learnt from every cycle the engine times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple


@dataclass
class Acceptance:
    """A row's per-token acceptance estimate from its recent cycles: decayed counts over a prior
    worth two drafts at p = 0.9 (a new row drafts the whole block; a drafter that fails is
    found out in a few cycles).

    A cycle that verified L rows and accepted a drafts adds a successes and, if a < L - 1, one
    failure (the first rejected draft); a fully accepted block says nothing past its end.
    """

    accepted: float = 0.0
    rejected: float = 0.0
    decay: float = 0.9
    prior_p: float = 0.9
    prior_weight: float = 2.0

    def update(self, accepted: int, verified: int) -> None:
        if verified <= 1:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (accepted < verified - 1)

    @property
    def p(self) -> float:
        w = self.prior_weight
        return (self.accepted + w * self.prior_p) / (self.accepted + self.rejected + w)


WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def expected_committed(p: float, L: int) -> float:
    """E(L) = 1 + p + ... + p^(L-1)."""
    if L <= 0:
        return 0.0
    return float(L) if p >= 1.0 else (1.0 - p**L) / (1.0 - p)


@dataclass
class CostModel:
    """Seconds per cycle: target(B, T) = t0 + t1 * B * T, draft(B) = d0 + d1 * B (measured at
    warm-up), plus what a cycle costs beyond its passes (host work, scatter, sync), learnt from
    the cycles the engine times: the median excess of the last ``window`` cycles of each kind
    (plain, drafting), so that a cycle slowed by a one-off compilation does not steer the rest."""

    t0: float = 1.0
    t1: float = 0.0
    d0: float = 0.0
    d1: float = 0.0
    window: int = 16  # cycles per kind in the running median (0: the passes alone)
    excess: Dict[bool, List[float]] = field(default_factory=lambda: {False: [], True: []})

    def passes(self, B: int, T: int) -> float:
        return self.t0 + self.t1 * B * T + (self.d0 + self.d1 * B if T > 1 else 0.0)

    def overhead(self, drafting: bool) -> float:
        seen = sorted(self.excess[drafting])
        return seen[len(seen) // 2] if seen else 0.0

    def cycle(self, B: int, T: int) -> float:
        return max(self.passes(B, T) + self.overhead(T > 1), 1e-9)

    def observe(self, B: int, T: int, seconds: float) -> None:
        if self.window:
            seen = self.excess[T > 1]
            seen.append(seconds - self.passes(B, T))
            del seen[: -self.window]

    @classmethod
    def fit(cls, target_times: Dict[Tuple[int, int], float], draft_times: Dict[int, float]) -> "CostModel":
        """Least squares of the two lines through measured (B, T) -> seconds and B -> seconds."""
        t0, t1 = _line([(B * T, s) for (B, T), s in target_times.items()])
        d0, d1 = _line(list(draft_times.items())) if draft_times else (0.0, 0.0)
        return cls(t0=t0, t1=t1, d0=d0, d1=d1)


def _line(points: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(intercept, slope), both at least 0; a single point is all intercept."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        return max(sum(y for _, y in points) / len(points), 1e-9), 0.0
    n = len(points)
    mx_ = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx_) * (y - my) for x, y in points) / sum((x - mx_) ** 2 for x, _ in points)
    slope = max(slope, 0.0)
    return max(my - slope * mx_, 1e-9), slope


class Scheduler:
    """Chooses each cycle's verify width (see module doc). ``fixed`` verifies the whole block
    every cycle (the cost model is not consulted).

    ``job`` pools every row's cycles: a row that joins starts from the job's acceptance, so a
    drafter that fails on this job's text is not tried afresh on every new row.
    """

    def __init__(self, block: int, cost: CostModel, fixed: bool = False, probe_share: float = 0.05, probe_width: int = 4):
        self.block, self.cost, self.fixed = block, cost, fixed
        self.probe_share, self.probe_width = probe_share, min(probe_width, block)
        self.job = Acceptance(decay=0.98)
        self.plain_seconds = 0.0  # spent in plain cycles since the last drafting cycle

    def widths(self, longest: int) -> List[int]:
        """The widths worth choosing among: each distinct pass shape is compiled once per
        process (and per 256 keys), so a handful of widths, the block and the budget cap."""
        top = min(self.block, longest)
        return sorted({w for w in WIDTHS if w < top} | {top})

    def new_row(self) -> Acceptance:
        return Acceptance(prior_p=self.job.p)

    def accepted(self, row: Acceptance, accepted: int, verified: int) -> None:
        row.update(accepted, verified)
        self.job.update(accepted, verified)

    def width(self, estimates: Sequence[Acceptance], budgets: Sequence[int]) -> int:
        """The verify width for the next cycle over rows with these estimates and token budgets."""
        longest = max(budgets)
        if self.block < 2 or longest < 2:
            return 1
        if self.fixed:
            return min(self.block, longest)
        B = len(budgets)
        best, best_rate = 1, -1.0
        for T in self.widths(longest):
            committed = sum(expected_committed(e.p, min(T, n)) for e, n in zip(estimates, budgets))
            rate = committed / self.cost.cycle(B, T)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = T, rate
        if best > 1:
            self.plain_seconds = 0.0
            return best
        # Plain decoding learns nothing about the drafts: probe once the plain cycles since the
        # last drafting cycle have cost 1 / probe_share times a probe (a probe costs that share).
        self.plain_seconds += self.cost.cycle(B, 1)
        probe = min(self.probe_width, longest)
        if self.plain_seconds * self.probe_share >= self.cost.cycle(B, probe):
            self.plain_seconds = 0.0
            return probe
        return 1
