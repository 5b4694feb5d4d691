"""The scheduler's counters: running totals since start, and a frozen snapshot of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    num_prompt_tokens_total: int
    num_computed_prompt_tokens_total: int  # not cache hits; recomputes count
    num_cached_tokens_total: int
    num_generation_tokens_total: int
    num_finished_total: int
    num_resumed_total: int = 0  # preempted or moved requests admitted again
    num_resumed_recomputed_tokens_total: int = 0  # of their known tokens, those neither pool nor tier had
    num_resumed_over_one_block_total: int = 0  # resumes that recompute more than one block's tokens
    num_tier_loaded_blocks_total: int = 0  # blocks the worker loaded from the offload tier
    num_tier_missed_blocks_total: int = 0  # planned loads it could not make: computed instead
    tier_load_seconds_total: float = 0.0
    tier_loaded_bytes_total: int = 0
    num_tier_stored_blocks_total: int = 0
    tier_stored_bytes_total: int = 0
    tier_store_seconds_total: float = 0.0


@dataclass
class SchedulerCounters:
    """Monotonic totals; only the Scheduler increments them."""

    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0
    num_computed_prompt_tokens_total: int = 0
    num_cached_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_finished_total: int = 0
    num_resumed_total: int = 0
    num_resumed_recomputed_tokens_total: int = 0
    num_resumed_over_one_block_total: int = 0
    num_tier_loaded_blocks_total: int = 0
    num_tier_missed_blocks_total: int = 0
    tier_load_seconds_total: float = 0.0
    tier_loaded_bytes_total: int = 0
    num_tier_stored_blocks_total: int = 0
    tier_stored_bytes_total: int = 0
    tier_store_seconds_total: float = 0.0

    def count_resume(self, num_recomputed: int, block_size: int) -> None:
        """A preempted or moved request admitted again, num_recomputed of its known tokens found in
        neither pool nor tier (block_size 0: unknown, never counted over one block)."""
        self.num_resumed_total += 1
        self.num_resumed_recomputed_tokens_total += num_recomputed
        self.num_resumed_over_one_block_total += 0 < block_size < num_recomputed

    def count_computed(self, request, num_scheduled: int) -> None:
        start = request.num_computed_tokens
        num_prompt = request.num_prompt_tokens
        self.num_computed_prompt_tokens_total += min(start + num_scheduled, num_prompt) - min(start, num_prompt)

    def count_tier(self, result) -> None:
        """A step result's tier loads and stores (StepResult)."""
        self.num_tier_loaded_blocks_total += result.num_tier_loaded_blocks
        self.num_tier_missed_blocks_total += result.num_tier_missed_blocks
        self.tier_load_seconds_total += result.tier_load_seconds
        self.tier_loaded_bytes_total += result.tier_loaded_bytes
        self.tier_stored_bytes_total += result.tier_stored_bytes
        self.num_tier_stored_blocks_total += result.num_tier_stored_blocks
        self.tier_store_seconds_total += result.tier_store_seconds

    def snapshot(self, num_running: int, num_waiting: int) -> SchedulerStats:
        return SchedulerStats(
            num_running=num_running,
            num_waiting=num_waiting,
            num_preemptions_total=self.num_preemptions_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_computed_prompt_tokens_total=self.num_computed_prompt_tokens_total,
            num_cached_tokens_total=self.num_cached_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_finished_total=self.num_finished_total,
            num_resumed_total=self.num_resumed_total,
            num_resumed_recomputed_tokens_total=self.num_resumed_recomputed_tokens_total,
            num_resumed_over_one_block_total=self.num_resumed_over_one_block_total,
            num_tier_loaded_blocks_total=self.num_tier_loaded_blocks_total,
            num_tier_missed_blocks_total=self.num_tier_missed_blocks_total,
            tier_load_seconds_total=self.tier_load_seconds_total,
            tier_loaded_bytes_total=self.tier_loaded_bytes_total,
            tier_stored_bytes_total=self.tier_stored_bytes_total,
            num_tier_stored_blocks_total=self.num_tier_stored_blocks_total,
            tier_store_seconds_total=self.tier_store_seconds_total,
        )
