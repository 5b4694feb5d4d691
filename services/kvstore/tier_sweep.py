"""Orphaned tier writes (landed after their reservation was cancelled: no confirmation comes) are in Redis
but neither indexed nor reserved; the loop scans SWEEP_COUNT keys per pass, a pass per SWEEP_INTERVAL_S."""

from __future__ import annotations

from pagedserve.services.kvstore.tier_index import TierIndex, TierKey

SWEEP_INTERVAL_S = 1.0
SWEEP_COUNT = 256


class TierSweep:
    def __init__(self, interval_s: float = SWEEP_INTERVAL_S, count: int = SWEEP_COUNT) -> None:
        if interval_s < 0 or count < 1:
            raise ValueError(f"a tier sweep needs an interval >= 0 and a count >= 1, got {interval_s}, {count}")
        self.interval_s, self.count = interval_s, count
        self.cursor = 0
        self.next_at = 0.0
        self.num_swept = 0

    def due(self, now: float) -> bool:
        return now >= self.next_at

    @staticmethod
    def orphans(tier: TierIndex, found: list[tuple[str, TierKey | None]]) -> list[str]:
        """Of (redis key, parsed tier key) pairs, the keys the tier neither holds nor reserves."""
        return [key for key, parsed in found
                if parsed is not None and parsed not in tier and not tier.is_pending(parsed)]

    def advance(self, cursor: int, now: float, num_deleted: int) -> None:
        self.cursor, self.next_at = cursor, now + self.interval_s
        self.num_swept += num_deleted
