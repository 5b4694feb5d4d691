"""step(): one batched allocation per scheduler step."""

import pytest

from pagedserve.shared.messages import ALLOC_NOT_ADMITTED, ALLOC_OK, ALLOC_PREEMPTED, AllocRequest
from tests.kvstore.factories import full_pool_of_three, make_manager, running, statuses, step, waiting

OK, PREEMPTED, NOT_ADMITTED = ALLOC_OK, ALLOC_PREEMPTED, ALLOC_NOT_ADMITTED


def test_running_candidates_get_only_their_new_block_ids():
    manager = make_manager(num_blocks=8, block_size=4)
    manager.allocate_slots("a", 4)
    manager.allocate_slots("b", 3)
    reply = step(manager, running("a", 1), running("b", 1), running("c", 2), step_id=7)
    assert statuses(reply) == [("a", OK, [2]), ("b", OK, []), ("c", OK, [3])]
    assert (reply.step_id, reply.num_free_blocks, reply.num_blocks) == (7, 4, 8)
    assert reply.block_copies == []


def test_frees_are_applied_before_any_allocation():
    manager = make_manager(num_blocks=4, block_size=4)
    manager.allocate_slots("a", 16)  # the whole pool: [0, 1, 2, 3]
    reply = step(manager, waiting("b", 16), free=("a", "unknown"))
    assert statuses(reply) == [("b", OK, [3, 2, 1, 0])]  # a's blocks, tail first


def test_a_dry_pool_preempts_the_last_running_candidate():
    manager = full_pool_of_three()
    reply = step(manager, running("a", 1), running("b", 1), running("c", 1))
    # a needs a block: c (the tail) is preempted and freed [5, 4]; a gets 5, b gets 4
    assert statuses(reply) == [("a", OK, [5]), ("b", OK, [4]), ("c", PREEMPTED, [])]
    assert manager.get_block_ids("a") == [0, 1, 5]
    assert manager.get_block_ids("b") == [2, 3, 4]
    assert not manager.has_request("c")
    assert manager.stats()["num_preemptions"] == 1


def test_preemption_goes_on_up_the_tail_until_the_request_fits():
    manager = full_pool_of_three()
    reply = step(manager, running("a", 12), running("b", 1), running("c", 1))
    # a needs 3 blocks: c frees [5, 4], still short, then b frees [3, 2]
    assert statuses(reply) == [("a", OK, [5, 4, 3]), ("b", PREEMPTED, []), ("c", PREEMPTED, [])]
    assert manager.pool.free_queue.block_ids() == [2]
    assert manager.num_preemptions == 2


def test_the_tail_candidate_preempts_itself_and_never_one_before_it():
    manager = make_manager(num_blocks=6, block_size=4)
    manager.allocate_slots("a", 8)  # [0, 1]
    manager.allocate_slots("b", 8)  # [2, 3]; free: [4, 5]
    reply = step(manager, running("a", 1), running("b", 9))
    # b needs 3 blocks and only 1 is left after a; a precedes b, so b preempts itself
    assert statuses(reply) == [("a", OK, [4]), ("b", PREEMPTED, [])]
    assert manager.get_block_ids("a") == [0, 1, 4]
    assert manager.pool.free_queue.block_ids() == [5, 3, 2]


def test_victims_are_only_running_candidates_and_never_non_candidates():
    manager = full_pool_of_three(num_blocks=7)  # block 6 free
    manager.allocate_slots("idle", 1)  # holds block 6, not a candidate this step
    reply = step(manager, running("b", 1), waiting("w", 4), running("a", 1))
    # b preempts a (the last running candidate), takes a's tail block 1;
    # w is not admitted: this step preempted, a's blocks are not for a waiting request
    assert statuses(reply) == [("b", OK, [1]), ("w", NOT_ADMITTED, []), ("a", PREEMPTED, [])]
    assert manager.get_block_ids("idle") == [6]
    assert manager.get_block_ids("c") == [4, 5]


def test_no_admission_after_a_preemption_even_when_it_would_fit():
    manager = full_pool_of_three()
    reply = step(manager, running("a", 1), running("c", 4), waiting("w", 1))
    # a preempts c (freeing [5, 4]); 4 is then free but w, after c in the order, waits
    assert statuses(reply) == [("a", OK, [5]), ("c", PREEMPTED, []), ("w", NOT_ADMITTED, [])]
    assert manager.num_free_blocks == 1


def test_a_waiting_candidate_after_every_running_one_never_preempts():
    manager = make_manager(num_blocks=2, block_size=4)
    manager.allocate_slots("a", 8)
    reply = step(manager, running("a", 0), waiting("w", 1))
    assert statuses(reply) == [("a", OK, []), ("w", NOT_ADMITTED, [])]
    assert manager.get_block_ids("a") == [0, 1]


def test_admission_needs_room_for_all_tokens_not_just_this_chunk():
    manager = make_manager(num_blocks=6, block_size=4)
    manager.allocate_slots("a", 8)  # 4 blocks free
    # a 20-token prompt (5 blocks) whose first chunk of 4 would fit: refused (thrash guard)
    reply = step(manager, waiting("long", 20, num_new_tokens=4))
    assert statuses(reply) == [("long", NOT_ADMITTED, [])]
    assert not manager.has_request("long")
    # 16 tokens (4 blocks) fit; only the chunk's block is allocated now
    reply = step(manager, waiting("fits", 16, num_new_tokens=4))
    assert statuses(reply) == [("fits", OK, [2])]
    assert reply.results[0].num_cached_tokens == 0
    assert manager.num_free_blocks == 3


def test_admission_keeps_the_watermark_free():
    manager = make_manager(num_blocks=10, block_size=4, watermark=0.1)  # 1 block reserved
    manager.allocate_slots("a", 8)  # 8 free
    assert statuses(step(manager, waiting("w", 32))) == [("w", NOT_ADMITTED, [])]  # 8 + 1 > 8
    assert statuses(step(manager, waiting("w", 28))) == [("w", OK, [2, 3, 4, 5, 6, 7, 8])]


def test_the_watermark_is_waived_while_no_block_is_held():
    manager = make_manager(num_blocks=4, block_size=4, watermark=0.25)
    reply = step(manager, waiting("w", 16), waiting("x", 1))
    # alone, w may take the whole pool; x then has to respect the watermark
    assert statuses(reply) == [("w", OK, [0, 1, 2, 3]), ("x", NOT_ADMITTED, [])]


def test_a_refused_waiting_candidate_stops_admission_of_later_ones():
    manager = make_manager(num_blocks=4, block_size=4)
    manager.allocate_slots("a", 4)
    reply = step(manager, running("a", 1), waiting("big", 16), waiting("small", 1))
    # small would fit, but it queues behind big (head of line); running ones still run
    assert statuses(reply) == [("a", OK, [1]), ("big", NOT_ADMITTED, []), ("small", NOT_ADMITTED, [])]


def test_an_admitted_waiting_candidate_gets_its_whole_table():
    manager = make_manager(num_blocks=8, block_size=4)
    reply = step(manager, waiting("w", 10, num_new_tokens=6), waiting("x", 3))
    assert statuses(reply) == [("w", OK, [0, 1]), ("x", OK, [2])]
    assert statuses(step(manager, running("w", 4))) == [("w", OK, [3])]


def test_a_waiting_candidate_with_a_stale_table_starts_afresh():
    manager = make_manager(num_blocks=4, block_size=4)
    manager.allocate_slots("w", 8)  # [0, 1], left over from before a restart
    reply = step(manager, waiting("w", 4))
    assert statuses(reply) == [("w", OK, [2])]
    assert manager.get_block_ids("w") == [2]


def test_an_id_freed_and_offered_in_one_step_is_freed_first():
    manager = make_manager(num_blocks=2, block_size=4)
    manager.allocate_slots("r", 8)
    reply = step(manager, waiting("r", 4), free=("r",))
    assert statuses(reply) == [("r", OK, [1])]


def test_a_bad_step_is_refused_before_anything_changes():
    manager = make_manager(num_blocks=4, block_size=4)
    manager.allocate_slots("a", 4)
    bad = [
        ([running("b", 1), running("b", 1)], "is a candidate twice"),
        ([running("b", -1)], "negative token count"),
        ([waiting("w", 0, num_new_tokens=0)], "has no tokens"),
        ([waiting("w", 3, token_ids=[1, 2])], "2 token ids for num_tokens=3"),
    ]
    for candidates, match in bad:
        with pytest.raises(ValueError, match=match):
            manager.step(AllocRequest(0, ["a"], candidates))
        assert manager.get_block_ids("a") == [0]
