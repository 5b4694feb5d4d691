"""The kvstore's reply to a step where every candidate runs on inside its partly filled last block (nothing
allocated, copied, filled or hashed): planned at once, its AllocRequest sent later and the reply checked then."""

from __future__ import annotations

from pagedserve.services.scheduler.request import RequestStatus
from pagedserve.services.scheduler.step import CandidateStep
from pagedserve.shared.messages import ALLOC_OK, AllocReply, AllocRequest, AllocResult

MAX_DEFERRED_ALLOCS = 64  # forecast steps whose AllocRequests wait for the next one that is sent


def forecast_reply(alloc: AllocRequest, pending: CandidateStep | None, block_size: int) -> AllocReply | None:
    """The reply the kvstore will give to alloc, or None where it can differ (or do anything but count slots)."""
    if (pending is None or block_size <= 0 or alloc.reset or alloc.free_request_ids or alloc.forks
            or alloc.tier_written or alloc.tier_filled or not pending.candidates
            or pending.drafts or pending.num_scheduled):
        return None
    for request, candidate in pending.candidates:
        if (candidate.is_waiting or request.status is not RequestStatus.RUNNING or request.is_fresh_fork
                or request.is_fork_parent or request.num_spare_slots or candidate.block_hashes):
            return None
        offset = request.num_computed_tokens % block_size  # the table's slots: its computed tokens
        if offset == 0 or offset + candidate.num_new_tokens >= block_size:
            return None  # a new block, or a block full after the step (hashed, stored, filled)
        known_from = candidate.token_ids_start
        if candidate.token_ids and (known_from < 0 or
                                    (known_from + len(candidate.token_ids)) // block_size != known_from // block_size):
            return None  # its known tokens complete a block: the kvstore hashes it
    return AllocReply(alloc.step_id, [AllocResult(c.request_id, ALLOC_OK) for _, c in pending.candidates],
                      worker_id=alloc.worker_id)


def run_ends_next(pending: CandidateStep, block_size: int) -> bool:
    """A candidate's next step starts or fills a block: the deferred requests go now, not before that reply."""
    return any((request.num_computed_tokens + candidate.num_new_tokens) % block_size + 1 >= block_size
               for request, candidate in pending.candidates)


def differs(forecast: AllocReply, reply: AllocReply) -> str | None:
    """What the reply does that the plan did not (None: nothing; its tier stores go unmade, as dropped ones)."""
    if reply.block_copies:
        return f"block copies {reply.block_copies}"
    got = [(r.request_id, r.status, r.new_block_ids, r.num_cached_tokens) for r in reply.results]
    wanted = [(r.request_id, r.status, r.new_block_ids, r.num_cached_tokens) for r in forecast.results]
    return None if got == wanted else f"results {got} for {wanted}"
