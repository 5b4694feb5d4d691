"""Which running requests a step displaces to make room for more important waiting ones.

Pure: it reads the queues and the policy and names the victims; the scheduler preempts
them and frees their blocks in the same AllocRequest that offers their displacers.
"""

from __future__ import annotations

from services.scheduler.policy import SchedulingPolicy
from services.scheduler.request import Request


def pick_displaced(policy: SchedulingPolicy, waiting: list[Request], running: list[Request],
                   max_num_seqs: int, token_budget: int, refused_ids: set[str]) -> list[Request]:
    """Waiting requests, in the policy's order, that need room (no free sequence slot, or
    the pool refused them last step: refused_ids) take the place of the tail of the
    running order where policy.may_displace allows. The first that may not stops it (head
    of line: the rest are less important). Only while the step's token budget, after
    every remaining decode, leaves the displacer a token. Victims in the order they were
    taken, from the tail of the running order."""
    survivors = list(running)
    planned: list[Request] = []  # waiting requests this step will offer
    num_free_seqs = max_num_seqs - len(running)
    budget = token_budget - len(running)
    victims: list[Request] = []
    for candidate in waiting:
        if budget <= 0:
            break
        if num_free_seqs <= 0 or candidate.request_id in refused_ids:
            if not survivors or not policy.may_displace(candidate, survivors[-1], survivors + planned):
                break
            victims.append(survivors.pop())
            budget += 1  # the victim's decode token is not spent
        else:
            num_free_seqs -= 1
        planned.append(candidate)
        budget -= candidate.num_tokens
    return victims
