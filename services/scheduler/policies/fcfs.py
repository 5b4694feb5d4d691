"""fcfs: earliest arrival first, latest preempted first; never displaces a running request."""

from __future__ import annotations

from pagedserve.services.scheduler.policy import KeyedPolicy, arrival_key


class FCFSPolicy(KeyedPolicy):
    name = "fcfs"
    sort_key = staticmethod(arrival_key)
