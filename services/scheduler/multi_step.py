"""Multi-step decoding (vLLM's --num-scheduler-steps): a step where every candidate decodes becomes up to N
decode steps in one plan, so the scheduler, kvstore and api wake once per N tokens. Each candidate is granted
the slots of all its steps, within max_tokens, max_model_len (tokens in flight counted) and the token budget;
the worker ends its steps at an EOS or stop token. A step with a prefill or a waiting candidate runs once."""

from __future__ import annotations

from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.step import CandidateStep


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
