"""How long a batch's rows take to finish (engine/widths.py, "The job's tail"), were every
remaining cycle run at one width T. Row b commits X_b tokens a cycle (its drafts accepted, plus
the bonus), at most L_b = min(T, budget_b); it needs about n_b / mean cycles for the n_b tokens
it has left, give or take sqrt(n_b var / mean^3)."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, List, Sequence, Tuple

_NORMAL = NormalDist()


class Ends:
    """How rows end: the decayed count of finished rows that ran to their budgets, of all
    finished rows, each over a prior of ``prior_weight`` rows that did. The finish model takes a
    row's budget as the tokens it has left; where most rows stop early (at EOS, or a stop
    string), the slot that ends last is the one whose answers run longest, which no width
    changes, and a job's last wave is weighed by the rate instead (engine/widths.py, "The job's
    tail")."""

    def __init__(self, decay: float = 0.98, prior_weight: float = 2.0):
        self.decay = decay
        self.at_budget = self.rows = prior_weight

    def observe(self, at_budget: bool) -> None:
        self.at_budget = self.decay * self.at_budget + at_budget
        self.rows = self.decay * self.rows + 1.0

    def run_to_budgets(self) -> bool:
        """Whether most rows run to their budgets."""
        return 2 * self.at_budget >= self.rows


def order_statistics(rows: int) -> List[float]:
    """Blom's approximation to the expected k-th smallest of ``rows`` standard normals, k = 1..rows."""
    return [_NORMAL.inv_cdf((k - 0.375) / (rows + 0.25)) for k in range(1, rows + 1)]


def moments(
    estimates: Sequence, budgets: Sequence[int], job: Sequence[float], widths: List[int]
) -> List[List[Tuple[float, float]]]:
    """Per width T, each row's (mean, variance) of X_b: with L = min(T, budget_b) and
    S_j = P(X_b >= j) = p_b1 ... p_b(j-1) (``estimates[b].probabilities(job)``), mean = E_b(L) =
    sum_{j <= L} S_j and E[X_b^2] = sum_{j <= L} (2j - 1) S_j."""
    top, rows = widths[-1], []
    for e, n in zip(estimates, budgets):
        p, reach = e.probabilities(job), min(top, n)
        mean, square, survive, table = 0.0, 0.0, 1.0, [(0.0, 0.0)]
        for j in range(1, reach + 1):
            mean, square = mean + survive, square + (2 * j - 1) * survive
            table.append((mean, max(square - mean * mean, 0.0)))
            survive *= p[j - 1] if j - 1 < len(p) else 0.0
        rows.append(table)
    return [[table[min(T, len(table) - 1)] for table in rows] for T in widths]


def finish_time(
    cycle: Callable[[int], float],
    T: int,
    moments: Sequence[Tuple[float, float]],
    budgets: Sequence[int],
    left: Sequence[int],
    z: Sequence[float],
) -> float:
    """Seconds until the last row finishes, every cycle of width T costing ``cycle(live rows)``:
    the last finish at the expected maximum of the rows' finishes (``expected_max``), the others,
    ranked by their mean, at the mean plus the spread times the order statistic ``z`` of their
    rank, capped at the last; each stretch between two finishes paid at the rows still live."""
    rows = sorted(
        (n / mu, n * var / mu**3, n / min(T, cap), n)
        for (mu, var), n, cap in zip(moments, left, budgets)
    )
    # the last finish within what the rows can do: n_b / L_b cycles at least, n_b at most
    floor, ceiling = max(r[2] for r in rows), max(r[3] for r in rows)
    last = min(max(expected_max([(mean, var) for mean, var, _, _ in rows]), floor), ceiling)
    finishes = sorted(
        min(max(mean + zk * math.sqrt(var), least), most, last)
        for zk, (mean, var, least, most) in zip(z, rows[:-1])
    ) + [last]
    time, before, B = 0.0, 0.0, len(finishes)
    for k, finish in enumerate(finishes):
        if finish > before:  # rows finishing together (plain decoding's): one stretch
            time += (finish - before) * cycle(B - k)
            before = finish
    return time


def expected_max(normals: Sequence[Tuple[float, float]]) -> float:
    """E[max] of independent normals (mean, variance), by Clark's fold: the max of the first ones
    is taken as a normal of that max's own mean and variance (exact for two normals), and maxed
    with the next."""
    mean, var = normals[0]
    for m, v in normals[1:]:
        a = math.sqrt(var + v)
        if a == 0:
            mean = max(mean, m)
            continue
        alpha = (mean - m) / a
        P, d = _NORMAL.cdf(alpha), _NORMAL.pdf(alpha)
        first = mean * P + m * (1 - P) + a * d
        second = (mean * mean + var) * P + (m * m + v) * (1 - P) + (mean + m) * a * d
        mean, var = first, max(second - first * first, 0.0)
    return mean
