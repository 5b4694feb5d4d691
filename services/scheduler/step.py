"""One step's bookkeeping between the scheduler's three phases.

CandidateStep (schedule() -> on_alloc()): which requests the step offers to the kvstore,
and how many tokens each wants. build_candidates shares the token budget out in three
passes:
1. one token to every running request, in the policy's running order: every decode runs
   (and every running prefill makes progress) before any prefill chunk grows;
2. the rest of each running request's prefill, in the same order, as far as budget lasts;
3. waiting requests (new or preempted), in the policy's waiting order, while sequence slots
   and budget remain; each asks for min(num_tokens_to_compute - num_computed_tokens,
   budget left): a prompt longer than the budget left is cut into chunks over several steps.
Candidates keep the policy's order (running first, then waiting) whatever pass granted
their tokens, because the kvstore preempts from the tail of that order.
Invariant: the sum of num_new_tokens over the candidates is <= token_budget.

InFlightStep (on_alloc() -> on_result()): what the plan scheduled, and what the worker's
answer must look like: one token for exactly those scheduled requests whose step reaches
the end of their known tokens (num_computed_tokens + num_scheduled == num_tokens); a
prefill chunk short of the end samples nothing. A request aborted while the step ran may
or may not get a token; it is dropped either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.request import Request
from shared.messages import AllocCandidate, SampledToken, StepResult


@dataclass
class CandidateStep:
    """A step built by schedule() and not yet answered by the kvstore."""

    step_id: int
    candidates: list[tuple[Request, AllocCandidate]] = field(default_factory=list)


def build_candidates(
    step_id: int,
    running: list[Request],
    waiting: list[Request],
    num_free_seqs: int,
    token_budget: int,
) -> CandidateStep:
    """running/waiting: in the policy's order. num_free_seqs: how many more may run."""
    budget_left = token_budget
    granted: dict[str, int] = {}
    for request in running:
        if budget_left == 0:
            break
        granted[request.request_id] = 1
        budget_left -= 1
    for request in running:
        if budget_left == 0 or request.request_id not in granted:
            break
        wanted = request.num_tokens_to_compute - request.num_computed_tokens
        extra = min(wanted - 1, budget_left)
        granted[request.request_id] += extra
        budget_left -= extra

    step = CandidateStep(step_id)
    for request in running:
        if request.request_id in granted:
            # the tokens this step computes, so the kvstore can hash blocks as they fill
            start = request.num_computed_tokens
            token_ids = request.token_ids_between(start, start + granted[request.request_id])
            candidate = AllocCandidate(request.request_id, granted[request.request_id], request.num_tokens,
                                       token_ids=token_ids)
            step.candidates.append((request, candidate))
    for request in waiting:
        if budget_left == 0 or num_free_seqs <= 0:
            break
        # a fork parent shows the kvstore only what it computes (all but the last prompt token)
        num_tokens = request.num_tokens_to_compute
        num_new_tokens = min(num_tokens - request.num_computed_tokens, budget_left)
        candidate = AllocCandidate(
            request.request_id,
            num_new_tokens,
            num_tokens,
            is_waiting=True,
            token_ids=request.token_ids_between(0, num_tokens),
            cache_salt=request.cache_salt,
        )
        step.candidates.append((request, candidate))
        budget_left -= num_new_tokens
        num_free_seqs -= 1
    return step


@dataclass
class InFlightStep:
    step_id: int
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)

    def sampled_tokens(self, result: StepResult) -> dict[str, SampledToken]:
        """The result's tokens by request id; ValueError if they disagree with the plan."""
        sampled = {token.request_id: token for token in result.sampled}
        if len(sampled) != len(result.sampled):
            raise ValueError("step result samples twice for one request")
        scheduled_ids = set()
        for request, num_scheduled in self.scheduled:
            scheduled_ids.add(request.request_id)
            if request.is_finished:
                continue
            reaches_end = request.num_computed_tokens + num_scheduled == request.num_tokens
            if reaches_end != (request.request_id in sampled):
                raise ValueError(f"step result and plan disagree on {request.request_id!r}")
        if not scheduled_ids.issuperset(sampled):
            raise ValueError("step result samples for a request that was not scheduled")
        return sampled
