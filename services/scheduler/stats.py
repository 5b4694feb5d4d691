"""The scheduler's counters: running totals since start, and a frozen snapshot of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    num_prompt_tokens_total: int  # prompt tokens of every request added
    num_cached_tokens_total: int  # prefix-cache hits (tokens not computed) over all admissions
    num_generation_tokens_total: int  # sampled tokens appended to outputs
    num_finished_total: int  # stopped, length and aborted


@dataclass
class SchedulerCounters:
    """Monotonic totals; only the Scheduler increments them."""

    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0
    num_cached_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_finished_total: int = 0

    def snapshot(self, num_running: int, num_waiting: int) -> SchedulerStats:
        return SchedulerStats(
            num_running=num_running,
            num_waiting=num_waiting,
            num_preemptions_total=self.num_preemptions_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_cached_tokens_total=self.num_cached_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_finished_total=self.num_finished_total,
        )
