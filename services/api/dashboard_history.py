"""The dashboard's last HISTORY_S of throughput and TTFT, kept by the api so a page opened now
draws its charts at once: one sample a SAMPLE_INTERVAL_S (the scheduler's generated tokens, this
api's TTFT sum and count), and per interval tokens/s and mean TTFT. Pure but for sample_forever."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

HISTORY_S = 300.0
SAMPLE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Sample:
    time: float
    generation_tokens_total: float
    ttft_sum: float
    ttft_count: float


class History:
    def __init__(self, horizon_s: float = HISTORY_S) -> None:
        self.horizon_s = horizon_s
        self.samples: collections.deque[Sample] = collections.deque()

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while self.samples and self.samples[0].time < sample.time - self.horizon_s:
            self.samples.popleft()

    def points(self) -> list[dict]:
        """[{t, tps, ttft}] per interval between consecutive samples, oldest first; tps >= 0 (a
        restarted scheduler's counter drops), ttft in ms or None when no first token came."""
        points = []
        for a, b in zip(self.samples, list(self.samples)[1:], strict=False):
            dt = b.time - a.time
            if dt <= 0:
                continue
            count = b.ttft_count - a.ttft_count
            points.append({"t": b.time, "tps": max(0.0, b.generation_tokens_total - a.generation_tokens_total) / dt,
                           "ttft": 1000 * (b.ttft_sum - a.ttft_sum) / count if count > 0 else None})
        return points


async def sample_forever(history: History, take: Callable[[], Awaitable[Sample]],
                         interval_s: float = SAMPLE_INTERVAL_S) -> None:
    """Adds take() to history every interval_s until cancelled; a failed take is skipped."""
    while True:
        with contextlib.suppress(Exception):  # Redis away: a gap in the chart, not a dead task
            history.add(await take())
        await asyncio.sleep(interval_s)
