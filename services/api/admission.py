"""Admission at the edge, before any stream opens: per-request limits (400, checked by
inputs.prepare) and the bounded waiting queue (429 + Retry-After) from the scheduler's
"admission" stats blob, read every REFRESH_S. With no table yet everything is admitted.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

from pagedserve.services.api.protocol import ApiError

REFRESH_S = 0.1
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


def check_limits(limits: RequestLimits, num_prompt_tokens: int, max_tokens: int, prompt_param: str) -> None:
    if limits.max_prompt_tokens is not None and num_prompt_tokens > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens, over this server's limit "
                       f"max_prompt_tokens={limits.max_prompt_tokens}", code="prompt_too_long", param=prompt_param)
    if limits.max_output_tokens is not None and max_tokens > limits.max_output_tokens:
        raise ApiError(400, f"max_tokens={max_tokens} is over this server's limit "
                       f"max_output_tokens={limits.max_output_tokens}", code="max_tokens_too_large",
                       param="max_tokens")


class AdmissionGate:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._table: dict | None = None
        self._admitted_since: Counter = Counter()  # per tenant, since the last table
        self._finished: tuple[float, float] | None = None  # (time, num_finished_total) last seen
        self._finish_rate = 0.0  # requests finished per second, smoothed

    def update(self, scheduler_stats: dict) -> None:
        """A fresh scheduler stats blob (the api loop calls this every REFRESH_S)."""
        table = scheduler_stats.get("admission")
        if not isinstance(table, dict):
            return
        self._table, self._admitted_since = table, Counter()
        finished = scheduler_stats.get("num_finished_total")
        now = self._clock()
        if isinstance(finished, (int, float)):
            if self._finished is not None and now > self._finished[0] and finished >= self._finished[1]:
                rate = (finished - self._finished[1]) / (now - self._finished[0])
                self._finish_rate = 0.8 * self._finish_rate + 0.2 * rate
            self._finished = (now, finished)

    def check(self, tenant: str | None) -> None:
        """ApiError(429) with Retry-After if the queue is closed to this tenant; else count it."""
        table = self._table
        if table is not None and not self._admits(table, tenant):
            waiting = int(table.get("num_waiting", 0)) + sum(self._admitted_since.values())
            bound = table.get("max_waiting_requests")
            retry_after = self.retry_after_s(waiting - (bound if isinstance(bound, int) else waiting) + 1)
            raise ApiError(429, f"the server's waiting queue is full ({waiting} requests waiting, bound "
                           f"{bound}, tokens bound {table.get('max_waiting_tokens')}); retry after {retry_after}s",
                           code="queue_full", type="rate_limit_error", headers={"Retry-After": str(retry_after)})
        self._admitted_since[tenant] += 1

    def retry_after_s(self, num_excess: int) -> int:
        """Seconds until about num_excess requests have finished at the recent rate (1..60)."""
        if self._finish_rate <= 0:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(max(1, num_excess) / self._finish_rate)))

    def _admits(self, table: dict, tenant: str | None) -> bool:
        admits = bool(table.get("admits", True))
        for entry in table.get("tenants") or []:
            if isinstance(entry, list) and len(entry) == 2 and entry[0] == tenant:
                admits = bool(entry[1])
        bound = table.get("max_waiting_requests")
        if admits and isinstance(bound, int) and self._admitted_since[tenant] > 0:
            # admits since the table count too, only for a tenant that sent some (no lock-out of others)
            admits = int(table.get("num_waiting", 0)) + sum(self._admitted_since.values()) < bound
        return admits
