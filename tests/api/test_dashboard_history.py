"""The dashboard's server-side history: per-interval tokens/s and mean TTFT from consecutive
samples, the last HISTORY_S kept, a failed sample skipped."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.api.dashboard_history import History, Sample, sample_forever


def test_points_are_rates_between_consecutive_samples():
    h = History()
    for sample in (Sample(100.0, 0, 0.0, 0), Sample(101.0, 30, 0.5, 2), Sample(103.0, 40, 0.5, 2),
                   Sample(104.0, 5, 0.5, 2)):  # the last: a restarted scheduler's counter
        h.add(sample)
    assert h.points() == [{"t": 101.0, "tps": 30.0, "ttft": 250.0}, {"t": 103.0, "tps": 5.0, "ttft": None},
                          {"t": 104.0, "tps": 0.0, "ttft": None}]


def test_only_the_horizon_is_kept():
    h = History(horizon_s=10)
    for t in range(30):
        h.add(Sample(float(t), t, 0.0, 0))
    assert [s.time for s in h.samples] == [float(t) for t in range(19, 30)]
    assert len(h.points()) == 10 and all(p["tps"] == 1.0 for p in h.points())


@pytest.mark.timeout(30)
def test_a_failed_sample_is_a_gap_not_the_end():
    h, calls = History(), []

    async def take() -> Sample:
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("redis away")
        return Sample(float(len(calls)), 0, 0.0, 0)

    async def run():
        task = asyncio.create_task(sample_forever(h, take, interval_s=0))
        while len(calls) < 4:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(run())
    assert [s.time for s in h.samples][:3] == [1.0, 3.0, 4.0]
