"""One step's bookkeeping: CandidateStep (schedule() -> on_alloc()), InFlightStep (-> on_result()).

build_candidates grants one token to each running request, then the rest of their prefills, then
waiting requests while seats (or displacement.py's reach) and budget last; in the policy's order, a waiting
one before the running ones it may displace; their num_new_tokens sum to <= token_budget. A prefill chunk shrinks with context
so tokens x context stays <= threshold x LONG_PREFILL_CONTEXT (attention costs tokens x context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.scheduler.request import Request
from pagedserve.shared.messages import AllocCandidate, SampledToken, StepResult

LONG_PREFILL_CONTEXT = 2048  # context up to which a chunk may take the whole threshold
MIN_PREFILL_CHUNK = 16


def prefill_chunk_cap(num_computed_tokens: int, threshold: int) -> int | None:
    """Most tokens one request may prefill this step with num_computed_tokens done; None: no cap."""
    if threshold <= 0:
        return None
    by_context = threshold * LONG_PREFILL_CONTEXT // (num_computed_tokens + threshold)
    return min(threshold, max(by_context, MIN_PREFILL_CHUNK))


@dataclass
class CandidateStep:
    step_id: int
    candidates: list[tuple[Request, AllocCandidate]] = field(default_factory=list)
    # speculation.py: drafts by request, and tokens to run where that differs from num_new_tokens
    drafts: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # multi_step.py: decode steps by request where more than one (num_new_tokens counts their slots)
    num_steps: dict[str, int] = field(default_factory=dict)


def build_candidates(
    step_id: int,
    running: list[Request],
    waiting: list[Request],
    num_free_seqs: int,
    token_budget: int,
    max_model_len: int,
    long_prefill_token_threshold: int = 0,
    reach: list[int] | None = None,
) -> CandidateStep:
    """running/waiting: in the policy's order. num_free_seqs: how many more may run (without reach)."""
    budget_left = token_budget
    position = {r.request_id: i for i, r in enumerate(running)}
    wanted = {r.request_id: r.num_tokens_wanted(max_model_len) for r in running}
    running = [r for r in running if wanted[r.request_id] > 0]
    for request in running:
        cap = prefill_chunk_cap(request.num_computed_tokens, long_prefill_token_threshold)
        if cap is not None and wanted[request.request_id] > cap:
            wanted[request.request_id] = cap
    granted: dict[str, int] = {}
    for request in running:
        if budget_left == 0:
            break
        granted[request.request_id] = 1
        budget_left -= 1
    for request in running:
        if budget_left == 0 or request.request_id not in granted:
            break
        extra = min(wanted[request.request_id] - 1, budget_left)
        granted[request.request_id] += extra
        budget_left -= extra

    step = CandidateStep(step_id)
    for request in running:
        if request.request_id in granted:
            # tokens learnt since its last candidate: blocks are hashed a step late, never with a gap
            start, stop = request.num_kv_known_tokens, request.num_tokens_to_compute - request.num_pending_tokens
            request.num_kv_known_tokens = max(start, stop)
            candidate = AllocCandidate(request.request_id, granted[request.request_id], request.num_tokens,
                                       token_ids=request.token_ids_between(start, stop), token_ids_start=start,
                                       block_hashes=hashes_between(request, start, stop))
            step.candidates.append((request, candidate))
    num_offered = len(reach) if reach is not None else num_free_seqs
    for index, request in enumerate(waiting):
        if budget_left == 0 or index >= num_offered:
            break
        if request.num_pending_tokens:
            continue  # its token is still in flight: offered once it is known
        num_tokens = request.num_tokens_to_compute
        num_new_tokens = min(num_tokens - request.num_computed_tokens, budget_left)
        cap = prefill_chunk_cap(request.num_computed_tokens, long_prefill_token_threshold)
        if cap is not None:
            num_new_tokens = min(num_new_tokens, cap)
        candidate = AllocCandidate(
            request.request_id,
            num_new_tokens,
            num_tokens,
            is_waiting=True,
            token_ids=request.token_ids_between(0, num_tokens),
            cache_salt=request.cache_salt,
            block_hashes=hashes_between(request, 0, num_tokens),
        )
        step.candidates.append((request, candidate))
        position[request.request_id] = reach[index] - 0.5 if reach is not None else len(position)
        budget_left -= num_new_tokens
    step.candidates.sort(key=lambda pair: position[pair[1].request_id])  # stable: each side keeps its order
    return step


def hashes_between(request: Request, start: int, stop: int) -> list[bytes]:
    """The hashes of the blocks tokens [start, stop) complete (its first: block start // block
    size), extending the request's own to stop; [] for a request without them."""
    hashes = request.block_hashes
    if hashes is None or stop <= start:
        return []
    if stop - hashes.num_tokens >= hashes.block_size:  # a block filled (most steps fill none)
        hashes.extend(request.token_ids_between(hashes.num_tokens, stop))
    return hashes.hashes[start // hashes.block_size: stop // hashes.block_size]


@dataclass
class ScheduledRequest:
    request: Request
    num_scheduled: int
    samples: bool  # the step reaches the end of its tokens: the worker samples one
    completes: bool  # the step reaches num_tokens_to_compute
    draft_token_ids: list[int] = field(default_factory=list)  # verified in this step (speculation.py)
    num_steps: int = 1  # decode steps in the plan (multi_step.py): 1..num_steps sampled tokens


@dataclass
class InFlightStep:
    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)

    def sampled_tokens(self, result: StepResult) -> dict[str, list[SampledToken]]:
        """The result's tokens by request id, in order; ValueError if they disagree with the plan."""
        sampled: dict[str, list[SampledToken]] = {}
        for token in result.sampled:
            sampled.setdefault(token.request_id, []).append(token)
        scheduled_ids = set()
        for entry in self.scheduled:
            request_id = entry.request.request_id
            scheduled_ids.add(request_id)
            if entry.request.is_finished:
                continue
            got = len(sampled.get(request_id, ()))
            if got > entry.num_steps:
                raise ValueError(f"step result samples {got} tokens for {request_id!r} in {entry.num_steps} steps")
            if entry.samples != (got > 0):
                raise ValueError(f"step result and plan disagree on {request_id!r}")
        if not scheduled_ids.issuperset(sampled):
            raise ValueError("step result samples for a request that was not scheduled")
        return sampled

    def accepted_drafts(self, result: StepResult) -> dict[str, list[SampledToken]]:
        """The result's accepted drafts by request id; ValueError for a request that had none."""
        accepted: dict[str, list[SampledToken]] = {}
        for token in result.draft_tokens:
            accepted.setdefault(token.request_id, []).append(token)
        drafted = {e.request.request_id: len(e.draft_token_ids) for e in self.scheduled if e.draft_token_ids}
        for request_id, tokens in accepted.items():
            if len(tokens) > drafted.get(request_id, 0):
                raise ValueError(f"step result accepts more drafts than {request_id!r} had")
        return accepted


def plan_tokens(request: Request, num_scheduled: int, counters, drafts: list[int] = (),
                num_steps: int = 1) -> ScheduledRequest:
    """Count a planned step's tokens (drafts, further decode steps) as computed now: async scheduling plans ahead."""
    end = request.num_computed_tokens + num_scheduled
    known_end = end - len(drafts)
    entry = ScheduledRequest(request, num_scheduled, samples=known_end == request.num_tokens + request.num_pending_tokens,
                             completes=known_end == request.num_tokens_to_compute, draft_token_ids=list(drafts),
                             num_steps=num_steps)
    counters.count_computed(request, num_scheduled + num_steps - 1)
    request.num_computed_tokens = end + num_steps - 1
    request.num_pending_tokens += num_steps if entry.samples else 0
    return entry
