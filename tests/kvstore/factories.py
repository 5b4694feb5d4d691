"""Factories for the kvstore tests: managers, candidates and steps with exact contents."""

from __future__ import annotations

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared import messages
from pagedserve.shared.messages import AllocCandidate, AllocReply, AllocRequest

OK, PREEMPTED, NOT_ADMITTED = messages.ALLOC_OK, messages.ALLOC_PREEMPTED, messages.ALLOC_NOT_ADMITTED


def make_manager(num_blocks: int = 8, block_size: int = 4, prefix: bool = False,
                 watermark: float = 0.0) -> BlockManager:
    """Small blocks and no watermark unless a test is about them, so ids are easy to follow."""
    return BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=watermark)


def full_pool_of_three(num_blocks: int = 6) -> BlockManager:
    """a, b, c each hold two full blocks of 4 tokens: a [0, 1], b [2, 3], c [4, 5]."""
    manager = make_manager(num_blocks=num_blocks, block_size=4)
    for request_id in "abc":
        manager.allocate_slots(request_id, 8)
    return manager


def running(request_id: str, num_new_tokens: int, num_tokens: int = 0) -> AllocCandidate:
    return AllocCandidate(request_id, num_new_tokens, num_tokens)


def waiting(request_id: str, num_tokens: int, num_new_tokens: int | None = None,
            token_ids: list[int] | None = None) -> AllocCandidate:
    """A waiting candidate; its whole prompt this step unless num_new_tokens says a chunk."""
    num_new_tokens = num_tokens if num_new_tokens is None else num_new_tokens
    return AllocCandidate(request_id, num_new_tokens, num_tokens, is_waiting=True,
                          token_ids=list(token_ids) if token_ids is not None else [])


def prompt(*block_tags: int, block_size: int = 4, extra: int = 0) -> list[int]:
    """Token ids made of whole blocks: prompt(1, 2) is block "1" then block "2" (each
    block_size copies of its tag), then `extra` tokens 900, 901, ... of a partial block."""
    return [tag for tag in block_tags for _ in range(block_size)] + [900 + i for i in range(extra)]


def step(manager: BlockManager, *candidates: AllocCandidate, free: tuple[str, ...] = (),
         step_id: int = 0, num_free_seqs: int = -1) -> AllocReply:
    reply = manager.step(AllocRequest(step_id, list(free), list(candidates), num_free_seqs=num_free_seqs))
    manager.check_integrity()
    return reply


def statuses(reply: AllocReply) -> list[tuple[str, str, list[int]]]:
    """(request_id, status, new_block_ids) per result, for exact comparisons."""
    return [(r.request_id, r.status, r.new_block_ids) for r in reply.results]
