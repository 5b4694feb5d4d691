"""Draft lengths that pay: each step's drafts maximise expected tokens per unit of step time.

step_cost(T): step time by tokens (in one-token steps) from a calibration table. A request's j-th draft
adds a^j expected tokens, a its acceptance rate (fading counts behind the batch's, which drift to
PRIOR_RATE). The best gains of all requests first; the count n that maximises
(sampled rows + gains) / step_cost(T + n) wins if it beats no drafts by MIN_GAIN.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

MIN_GAIN = 0.02  # drafting must promise at least 2% more tokens per unit time than not drafting
DECAY = 0.85  # per step a request decodes in: its acceptance counts fade, half-life ~4 steps
OVERALL_DECAY = 0.95  # per step: the batch-wide counts, half-life ~14 steps
PRIOR_RATE = 0.5  # where the batch-wide rate drifts back to without verdicts, so drafting is tried again
PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior behind counts


def step_cost(costs: Sequence[tuple[int, float]], num_tokens: int) -> float:
    """Relative time of a step of num_tokens tokens; costs: (tokens, cost) with tokens increasing."""
    i = bisect_left(costs, (num_tokens, float("-inf")))
    if i == len(costs):
        last_n, last_cost = costs[-1]
        return last_cost * num_tokens / last_n
    n1, c1 = costs[i]
    if n1 == num_tokens or i == 0:
        return c1
    n0, c0 = costs[i - 1]
    return c0 + (c1 - c0) * (num_tokens - n0) / (n1 - n0)


@dataclass
class Acceptance:
    """Fading counts of accepted drafts and of rejections (at most one a verification)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def fade(self, factor: float) -> None:
        self.accepted *= factor
        self.rejected *= factor

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejected += num_accepted < num_drafted

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


def choose_lengths(costs: Sequence[tuple[int, float]], num_tokens: int, num_sampled: int,
                   offers: Sequence[tuple[float, int]]) -> list[int]:
    """Drafts for each offer (acceptance rate, drafts available) in a step of num_tokens tokens that
    samples num_sampled tokens without drafts; the lengths that maximise tokens per unit time."""
    gains = sorted(((rate ** j, -i) for i, (rate, most) in enumerate(offers) for j in range(1, most + 1)),
                   reverse=True)
    base = num_sampled / step_cost(costs, num_tokens)
    best_n, best, total = 0, base * (1.0 + MIN_GAIN), float(num_sampled)
    for n, (gain, _) in enumerate(gains, 1):
        total += gain
        value = total / step_cost(costs, num_tokens + n)
        if value > best:
            best_n, best = n, value
    lengths = [0] * len(offers)
    for _, minus_i in gains[:best_n]:
        lengths[-minus_i] += 1
    return lengths


@functools.lru_cache(maxsize=256)
def draft_threshold(costs: tuple[tuple[int, float], ...], num_tokens: int, num_sampled: int, most: int = 1) -> float:
    """The rate above which choose_lengths drafts with `most` on offer (> 1: never); past a cliff in the
    table a long draft can pay where one does not."""
    base = (1.0 + MIN_GAIN) * num_sampled / step_cost(costs, num_tokens)
    best = base * step_cost(costs, num_tokens + 1) - num_sampled
    for n in range(2, most + 1):
        need = base * step_cost(costs, num_tokens + n) - num_sampled
        if need >= n or _geometric(min(best, 1.0), n) <= need:
            continue
        low, high = 0.0, min(best, 1.0)
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if _geometric(mid, n) <= need else (low, mid)
        best = high
    return best


def _geometric(rate: float, n: int) -> float:
    return sum(rate ** j for j in range(1, n + 1))
