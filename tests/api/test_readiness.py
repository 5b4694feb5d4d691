"""Readiness: a burst of requests shares one back-end check; the cache holds it CHECK_INTERVAL_S."""

from __future__ import annotations

import asyncio

from pagedserve.services.api.readiness import Readiness


class SlowBackEnd:
    """missing_services() answers what `answer` holds once `release` is set; counts its calls."""

    def __init__(self) -> None:
        self.calls, self.answer, self.release = 0, ["worker"], asyncio.Event()

    async def missing_services(self) -> list[str]:
        self.calls += 1
        await self.release.wait()
        return list(self.answer)


def test_a_burst_shares_one_check_and_the_answer_is_cached():
    async def run():
        back_end = SlowBackEnd()
        readiness = Readiness(back_end)
        burst = [asyncio.create_task(readiness.missing()) for _ in range(50)]
        await asyncio.sleep(0)
        back_end.release.set()
        assert await asyncio.gather(*burst) == [["worker"]] * 50
        assert back_end.calls == 1
        back_end.answer = []
        assert await readiness.missing() == ["worker"] and back_end.calls == 1  # cached
        assert await readiness.missing(fresh=True) == [] and back_end.calls == 2

    asyncio.run(run())


def test_a_cancelled_caller_leaves_the_check_to_the_others():
    async def run():
        back_end = SlowBackEnd()
        readiness = Readiness(back_end)
        first, second = asyncio.create_task(readiness.missing()), asyncio.create_task(readiness.missing())
        await asyncio.sleep(0)
        first.cancel()
        back_end.release.set()
        assert await second == ["worker"] and back_end.calls == 1
        assert first.cancelled()

    asyncio.run(run())
