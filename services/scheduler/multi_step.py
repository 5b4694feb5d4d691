"""Multi-step decoding (vLLM's --num-scheduler-steps): a step where every candidate decodes becomes up to N
decode steps in one plan, so the scheduler, kvstore and api wake once per N tokens. Each candidate is granted
the slots of all its steps, within max_tokens, max_model_len (tokens in flight counted) and the token budget;
the worker ends its steps at an EOS or stop token. A step with a prefill or a waiting candidate runs once, and
a plan lasts about MAX_PLAN_SECONDS at most, so an arrival waits little for the plans in flight."""

from __future__ import annotations

from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.step import CandidateStep, InFlightStep

MAX_PLAN_SECONDS = 1.0  # a plan's decode steps last about this at most: what an arrival may wait per plan
DECAY = 0.8


class PlanLength:
    """Steps a plan may take: --num-scheduler-steps, fewer where decode steps are slow (measured)."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.step_seconds = 0.0  # a decode step's moving average; 0: none measured yet

    def observe(self, step: InFlightStep, step_seconds: float) -> None:
        num_steps = max((e.num_steps for e in step.scheduled), default=0)
        if step_seconds <= 0 or not num_steps or any(e.num_scheduled != 1 or e.draft_token_ids for e in step.scheduled):
            return
        seconds = step_seconds / num_steps
        self.step_seconds = seconds if not self.step_seconds else DECAY * self.step_seconds + (1 - DECAY) * seconds

    def steps(self) -> int:
        if self.step_seconds <= 0:
            return self.max_steps
        return max(1, min(self.max_steps, int(MAX_PLAN_SECONDS / self.step_seconds)))


def decode_steps(request: Request, max_steps: int, max_model_len: int) -> int:
    pending = request.num_pending_tokens
    room = min(request.sampling.max_tokens - request.num_output_tokens - pending,
               max_model_len - request.num_tokens - pending)
    return max(1, min(max_steps, room))


def is_decoding(request: Request, num_new_tokens: int, max_model_len: int) -> bool:
    return (num_new_tokens == 1 and request.num_tokens_wanted(max_model_len) == 1 and not request.is_fresh_fork
            and not request.is_fork_parent and not request.num_spare_slots)


def plan_steps(step: CandidateStep, max_steps: int, max_model_len: int, token_budget: int) -> None:
    """If every candidate decodes, each gets its steps (num_steps, num_new_tokens), the budget counting all."""
    max_steps = min(max_steps, token_budget // max(1, len(step.candidates)))
    if max_steps <= 1 or not step.candidates or step.drafts:
        return
    if any(candidate.is_waiting or not is_decoding(request, candidate.num_new_tokens, max_model_len)
           for request, candidate in step.candidates):
        return
    for request, candidate in step.candidates:
        num_steps = decode_steps(request, max_steps, max_model_len)
        if num_steps > 1:
            step.num_steps[candidate.request_id] = num_steps
            candidate.num_new_tokens = num_steps
