"""Which running requests a step displaces for more important waiting ones (pure: names victims)."""

from __future__ import annotations

from pagedserve.services.scheduler.policy import SchedulingPolicy
from pagedserve.services.scheduler.request import Request


def pick_displaced(policy: SchedulingPolicy, waiting: list[Request], running: list[Request],
                   max_num_seqs: int, token_budget: int, refused_ids: set[str]) -> list[Request]:
    """Running tail requests that waiting ones needing room may displace (policy.may_displace), in the
    order taken; the first refusal stops it (head of line)."""
    survivors = list(running)
    planned: list[Request] = []
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
