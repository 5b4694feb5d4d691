"""The policy's displacement as data: a waiting request stands before the running tail it may
displace (the kvstore's alloc step takes those after a candidate, tail first), in waiting order."""

from __future__ import annotations

from pagedserve.services.scheduler.policy import SchedulingPolicy
from pagedserve.services.scheduler.request import Request


def displacement_reach(policy: SchedulingPolicy, waiting: list[Request], running: list[Request],
                       num_free_seqs: int) -> list[int]:
    """Per waiting request offered, the index into running it stands before (past the seats: takes the tail)."""
    survivors = list(running)  # those a seatless earlier request has not taken
    planned: list[Request] = []
    reach: list[int] = []
    floor = 0
    for candidate in waiting:
        num_taken = 0
        while (len(survivors) - num_taken > floor
               and policy.may_displace(candidate, survivors[len(survivors) - num_taken - 1],
                                       survivors[:len(survivors) - num_taken] + planned
                                       + ([candidate] if num_taken else []))):
            num_taken += 1
        floor = len(survivors) - num_taken
        if num_free_seqs > 0:
            num_free_seqs -= 1
        elif num_taken:
            survivors.pop()
        else:
            break
        planned.append(candidate)
        reach.append(floor)
    return reach
