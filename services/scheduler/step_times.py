"""draft_cost.py's step-cost table: per token-count bucket the median of its last WINDOW step times (robust to
a warm-up), in the prior's units (median measured/prior); unmeasured buckets keep the prior's points."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from pagedserve.services.scheduler.draft_cost import step_cost

EXACT_TOKENS = 16  # counts up to this get a bucket each: draft lengths are decided among them
MIN_SAMPLES = 3  # steps a bucket needs before its median replaces the prior
WINDOW = 16  # a bucket's steps kept: it follows load and context length
REBUILD_EVERY = 32


def bucket_of(num_tokens: int) -> int:
    return num_tokens if num_tokens <= EXACT_TOKENS else 1 << (num_tokens - 1).bit_length()


class _Bucket:
    """A bucket's last WINDOW steps as (tokens, seconds); count: every step it ever saw."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.count = 0

    def add(self, num_tokens: int, seconds: float) -> None:
        self.steps.append((num_tokens, seconds))
        self.count += 1

    def point(self) -> tuple[float, float]:
        """(mean tokens, median seconds per token x mean tokens): a bucket past EXACT_TOKENS spans counts."""
        tokens = sum(n for n, _ in self.steps) / len(self.steps)
        return tokens, statistics.median(s / n for n, s in self.steps) * tokens


class StepTimes:
    def __init__(self, prior: Sequence[tuple[int, float]], learns: bool = True) -> None:
        self.prior = tuple(prior)
        self.learns = learns
        self._buckets: dict[int, _Bucket] = {}
        self._table = self.prior
        self._since_rebuild = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < 1 or seconds <= 0.0 or not self.learns:
            return
        self._buckets.setdefault(bucket_of(num_tokens), _Bucket()).add(num_tokens, seconds)
        self._since_rebuild += 1
        if self._since_rebuild >= REBUILD_EVERY:
            self._table = self.rebuild()

    def table(self) -> tuple[tuple[int, float], ...]:
        return self._table

    def rebuild(self) -> tuple[tuple[int, float], ...]:
        """Costs non-decreasing in tokens: a measured dip is noise, a longer step is never cheaper."""
        self._since_rebuild = 0
        measured = {key: b.point() for key, b in self._buckets.items() if b.count >= MIN_SAMPLES}
        if not measured:
            return self.prior
        scale = statistics.median(s / step_cost(self.prior, round(n)) for n, s in measured.values())
        points = {round(n): s / scale for n, s in measured.values()}
        for n, cost in self.prior:
            if bucket_of(n) not in measured:
                points.setdefault(n, cost)
        table, highest = [], 0.0
        for n in sorted(points):
            highest = max(highest, points[n])
            table.append((n, highest))
        return tuple(table)
