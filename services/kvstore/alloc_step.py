"""One step's allocation and the only place that preempts: a candidate short of blocks (or a seat) takes the
last unanswered running candidate after it, else a running one gives up its own; the first refusal stops admission."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.shared.messages import (
    ALLOC_NOT_ADMITTED,
    ALLOC_OK,
    ALLOC_PREEMPTED,
    AllocCandidate,
    AllocReply,
    AllocRequest,
    AllocResult,
)

if TYPE_CHECKING:
    from pagedserve.services.kvstore.block_manager import BlockManager


def run_step(manager: BlockManager, request: AllocRequest) -> AllocReply:
    _validate(manager, request)  # before anything changes: a bad request changes nothing
    manager.take_block_copies()  # a fine-grained caller's leftovers are not this step's
    if manager.tier is not None:
        manager.tier.begin_step()
    for fork in request.forks:
        manager.fork(fork.parent_id, fork.child_ids)
    for request_id in request.free_request_ids:
        manager.free(request_id)
    candidates = request.candidates
    results: list[AllocResult | None] = [None] * len(candidates)  # None: not answered yet
    admitting = True  # False from the first refused admission or dry-pool preemption on
    num_preemptions_before = manager.num_preemptions
    seats = request.num_free_seqs if request.num_free_seqs >= 0 else len(candidates)
    for index, candidate in enumerate(candidates):
        if results[index] is not None:
            continue  # preempted for a more important candidate
        if not candidate.is_waiting:
            num_preemptions = manager.num_preemptions
            results[index] = _allocate_running(manager, candidates, results, index)
            admitting = admitting and manager.num_preemptions == num_preemptions
            continue
        manager.free(candidate.request_id)  # a waiting request holds nothing: drop a stale table
        num_free_seats = seats + manager.num_preemptions - num_preemptions_before
        admitted = _admit(manager, candidates, results, index, num_free_seats) if admitting else None
        if admitted is None:
            admitting = False
            results[index] = AllocResult(candidate.request_id, ALLOC_NOT_ADMITTED)
        else:
            seats -= 1
            block_ids, num_cached_tokens = admitted
            results[index] = AllocResult(candidate.request_id, ALLOC_OK, block_ids, num_cached_tokens,
                                         manager.take_tier_loads(candidate.request_id))
    return AllocReply(request.step_id, results, block_copies=manager.take_block_copies(),
                      num_free_blocks=manager.num_free_blocks, num_blocks=manager.num_blocks,
                      tier_stores=manager.tier.take_stores() if manager.tier is not None else [],
                      tier_fills=manager.tier.take_fills() if manager.tier is not None else [])


def _allocate_running(manager: BlockManager, candidates: list[AllocCandidate],
                      results: list[AllocResult | None], index: int) -> AllocResult:
    candidate = candidates[index]
    whole_table = manager.is_fresh_fork(candidate.request_id)  # the worker has not seen it
    while True:
        new_block_ids = manager.allocate_slots(candidate.request_id, candidate.num_new_tokens, candidate.token_ids,
                                               candidate.token_ids_start, candidate.block_hashes)
        if new_block_ids is not None:
            if whole_table:
                new_block_ids = manager.get_block_ids(candidate.request_id)
            return AllocResult(candidate.request_id, ALLOC_OK, new_block_ids)
        victim = _last_unanswered_running(candidates, results, index)
        manager.preempt(candidates[victim].request_id)
        results[victim] = AllocResult(candidates[victim].request_id, ALLOC_PREEMPTED)
        if victim == index:
            return results[victim]


def _admit(manager: BlockManager, candidates: list[AllocCandidate], results: list[AllocResult | None],
           index: int, num_free_seats: int) -> tuple[list[int], int] | None:
    """Admit it, displacing running ones after it while it lacks a seat or blocks; None: none left."""
    candidate = candidates[index]
    while True:
        if num_free_seats > 0:
            admitted = manager.admit(candidate.request_id, candidate.num_tokens, candidate.num_new_tokens,
                                     candidate.token_ids, candidate.cache_salt, candidate.block_hashes)
            if admitted is not None:
                return admitted
        victim = _last_unanswered_running(candidates, results, index)
        if victim == index:
            return None
        manager.preempt(candidates[victim].request_id)
        results[victim] = AllocResult(candidates[victim].request_id, ALLOC_PREEMPTED)
        num_free_seats += 1


def _last_unanswered_running(candidates: list[AllocCandidate], results: list[AllocResult | None],
                             index: int) -> int:
    """The least important unanswered running candidate at or after index (index itself qualifies)."""
    for victim in range(len(candidates) - 1, index, -1):
        if not candidates[victim].is_waiting and results[victim] is None:
            return victim
    return index


def _validate(manager: BlockManager, request: AllocRequest) -> None:
    """A reused id may be both freed and a candidate (free first); a fork child may be freed as it forks."""
    forked: set[str] = set()
    for fork in request.forks:
        if not manager.has_request(fork.parent_id) or fork.parent_id in forked:
            raise ValueError(f"step {request.step_id}: fork of {fork.parent_id!r}, which holds no table")
        for child_id in fork.child_ids:
            if child_id in forked or manager.has_request(child_id):
                raise ValueError(f"step {request.step_id}: fork child {child_id!r} already holds a table")
        forked.update(fork.child_ids)
        forked.add(fork.parent_id)
    seen: set[str] = set()
    for candidate in request.candidates:
        if candidate.request_id in seen:
            raise ValueError(f"step {request.step_id}: request {candidate.request_id!r} is a candidate twice")
        seen.add(candidate.request_id)
        if candidate.num_new_tokens < 0 or candidate.num_tokens < 0:
            raise ValueError(f"step {request.step_id}: {candidate.request_id!r} has a negative token count")
        if candidate.is_waiting and candidate.num_tokens < 1:
            raise ValueError(f"step {request.step_id}: waiting {candidate.request_id!r} has no tokens")
        if (not candidate.is_waiting and candidate.token_ids_start < 0
                and len(candidate.token_ids) not in (0, candidate.num_new_tokens)):
            raise ValueError(f"step {request.step_id}: running {candidate.request_id!r} has "
                             f"{len(candidate.token_ids)} token ids for num_new_tokens={candidate.num_new_tokens}")
        if candidate.is_waiting and candidate.token_ids and len(candidate.token_ids) != candidate.num_tokens:
            raise ValueError(f"step {request.step_id}: waiting {candidate.request_id!r} has "
                             f"{len(candidate.token_ids)} token ids for num_tokens={candidate.num_tokens}")
        _validate_hashes(candidate, manager.block_size, request.step_id)


def _validate_hashes(candidate: AllocCandidate, block_size: int, step_id: int) -> None:
    """Given hashes are one per block the candidate's token ids fill (a waiting request's: all)."""
    if not candidate.block_hashes:
        return
    start = 0 if candidate.is_waiting else candidate.token_ids_start
    wanted = (start + len(candidate.token_ids)) // block_size - start // block_size if start >= 0 else -1
    if len(candidate.block_hashes) != wanted or any(len(h) != 32 for h in candidate.block_hashes):
        raise ValueError(f"step {step_id}: {candidate.request_id!r} has {len(candidate.block_hashes)} block "
                         f"hashes for its {len(candidate.token_ids)} token ids from {start}")
