"""Forks (n > 1) and copy-on-write, with exact block ids: the prompt's blocks are shared by
every child; a child's first token into the shared partial last block gets it a copy."""

import pytest

from pagedserve.shared.messages import ALLOC_OK, ALLOC_PREEMPTED, AllocRequest, Fork
from tests.kvstore.factories import make_manager, prompt, running, statuses, step, waiting

TOKENS = prompt(1, 2, extra=2)  # 10 tokens: blocks "1", "2" and a partial [900, 901]


def forked(num_blocks: int, tokens: list[int], child_ids: list[str]):
    """A parent prefilled up to its last prompt token, then forked into child_ids, each
    computing that last token: the step the scheduler sends after the parent's prefill."""
    manager = make_manager(num_blocks=num_blocks, block_size=4, prefix=True)
    step(manager, waiting("p", len(tokens), num_new_tokens=len(tokens) - 1, token_ids=tokens))
    reply = step(manager, *(running(c, 1) for c in child_ids), step_id=1)
    return manager, reply


def fork_step(manager, child_ids, parent="p", free=(), tokens=TOKENS):
    request = AllocRequest(1, list(free), [running(c, 1) for c in child_ids if c not in free],
                           forks=[Fork(parent, list(child_ids))])
    for candidate in request.candidates:
        candidate.token_ids = [tokens[-1]]
    reply = manager.step(request)
    manager.check_integrity()
    return reply


def test_children_share_the_prompt_and_copy_the_partial_block_on_write():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))  # [0, 1, 2], 9 slots
    reply = fork_step(manager, ["c0", "c1", "c2"])
    # first grants list whole tables; the last child holding block 2 keeps it uncopied
    assert statuses(reply) == [("c0", ALLOC_OK, [0, 1, 3]), ("c1", ALLOC_OK, [0, 1, 4]), ("c2", ALLOC_OK, [0, 1, 2])]
    assert reply.block_copies == [(2, 3), (2, 4)]
    assert not manager.has_request("p")
    assert [manager.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    assert manager.stats()["num_block_copies"] == 2
    # later grants are diffs again: position 10 still fits each child's own last block
    later = step(manager, running("c0", 1), running("c1", 2), step_id=2)
    assert statuses(later) == [("c0", ALLOC_OK, []), ("c1", ALLOC_OK, [])] and later.block_copies == []


def test_a_prompt_ending_on_a_block_boundary_needs_no_copy():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    tokens = prompt(1, 2, extra=1)  # 9 tokens: the parent computes 8 = two full blocks
    step(manager, waiting("p", 9, num_new_tokens=8, token_ids=tokens))
    reply = fork_step(manager, ["c0", "c1"], tokens=tokens)
    assert statuses(reply) == [("c0", ALLOC_OK, [0, 1, 2]), ("c1", ALLOC_OK, [0, 1, 3])]
    assert reply.block_copies == []


def test_children_not_granted_in_the_fork_step_keep_the_shared_table():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))
    reply = manager.step(AllocRequest(1, [], [running("c1", 1)], forks=[Fork("p", ["c0", "c1"])]))
    assert statuses(reply) == [("c1", ALLOC_OK, [0, 1, 3])] and reply.block_copies == [(2, 3)]
    assert manager.get_block_ids("c0") == [0, 1, 2] and manager.is_fresh_fork("c0")
    manager.check_integrity()
    later = step(manager, running("c0", 1), step_id=2)  # its first grant: whole table, no copy left to make
    assert statuses(later) == [("c0", ALLOC_OK, [0, 1, 2])] and later.block_copies == []


def test_a_copy_the_pool_cannot_give_preempts_from_the_tail():
    manager = make_manager(num_blocks=4, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))  # [0, 1, 2], block 3 free
    reply = fork_step(manager, ["c0", "c1", "c2"])
    # c0 takes the last free block for its copy; c1 needs one too, so the tail c2 goes:
    # that frees nothing, but now c1 is block 2's last holder and writes it in place
    assert statuses(reply) == [("c0", ALLOC_OK, [0, 1, 3]), ("c1", ALLOC_OK, [0, 1, 2]),
                               ("c2", ALLOC_PREEMPTED, [])]
    assert reply.block_copies == [(2, 3)]
    assert manager.pool.free_queue.block_ids() == []


def test_a_child_aborted_in_the_fork_step_is_freed_after_the_fork():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))
    reply = fork_step(manager, ["c0", "c1"], free=("c1",))
    assert statuses(reply) == [("c0", ALLOC_OK, [0, 1, 2])] and reply.block_copies == []
    assert [manager.pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]


def test_children_hash_their_own_generated_blocks():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))
    fork_step(manager, ["c0", "c1"])  # c0 [0, 1, 3], c1 [0, 1, 2]; 10 slots each
    for step_id, tokens in ((2, (7, 8)), (3, (5, 5))):  # positions 10 and 11 fill the third block
        candidates = [running(child, 1) for child in ("c0", "c1")]
        for candidate, token in zip(candidates, tokens, strict=True):
            candidate.token_ids = [token]
        step(manager, *candidates, step_id=step_id)
    c0, c1 = manager.get_block_ids("c0"), manager.get_block_ids("c1")
    assert (c0, c1) == ([0, 1, 3], [0, 1, 2])
    assert manager.stats()["num_cached_blocks"] == 4  # "1", "2" and each child's own third block
    manager.free("c0")
    reply = step(manager, waiting("x", 13, token_ids=TOKENS + [7, 5, 0]), step_id=4)
    assert statuses(reply) == [("x", ALLOC_OK, [0, 1, 3, 4])] and reply.results[0].num_cached_tokens == 12


@pytest.mark.parametrize("forks, match", [
    ([Fork("nobody", ["c0"])], "holds no table"),
    ([Fork("p", ["p"])], "already holds a table"),
    ([Fork("p", ["c0"]), Fork("p", ["c1"])], "holds no table"),
])
def test_a_bad_fork_changes_nothing(forks, match):
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("p", 10, num_new_tokens=9, token_ids=TOKENS))
    with pytest.raises(ValueError, match=match):
        manager.step(AllocRequest(1, [], [], forks=forks))
    assert manager.get_block_ids("p") == [0, 1, 2]
    manager.check_integrity()
