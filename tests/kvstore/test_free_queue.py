import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.services.kvstore.block import KVBlock
from pagedserve.services.kvstore.free_queue import FreeQueue


def make_queue(num_blocks: int) -> tuple[FreeQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in range(num_blocks)]
    return FreeQueue(blocks), blocks


def test_starts_in_given_order_and_pops_from_the_front():
    queue, blocks = make_queue(4)
    assert queue.block_ids() == [0, 1, 2, 3]
    assert len(queue) == 4
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert queue.block_ids() == [2, 3]
    assert blocks[0] not in queue and blocks[2] in queue
    queue.check_integrity()


def test_append_goes_to_the_end():
    queue, blocks = make_queue(3)
    first = queue.popleft()
    queue.append(first)
    assert queue.block_ids() == [1, 2, 0]
    queue.check_integrity()


@pytest.mark.parametrize("removed, left", [(0, [1, 2, 3]), (2, [0, 1, 3]), (3, [0, 1, 2])])
def test_remove_from_head_middle_or_tail(removed, left):
    queue, blocks = make_queue(4)
    queue.remove(blocks[removed])
    assert queue.block_ids() == left
    assert blocks[removed].prev_free is None and blocks[removed].next_free is None
    queue.check_integrity()


def test_emptied_queue_raises_on_popleft_and_refills():
    queue, blocks = make_queue(2)
    queue.popleft()
    queue.popleft()
    assert len(queue) == 0 and queue.block_ids() == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.append(blocks[1])
    assert queue.block_ids() == [1]
    queue.check_integrity()


def test_double_append_and_remove_of_absent_block_are_refused():
    queue, blocks = make_queue(2)
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    outsider = KVBlock(7)
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(outsider)
    assert queue.block_ids() == [0, 1]


def test_check_integrity_reports_a_broken_back_link():
    queue, blocks = make_queue(3)
    blocks[2].prev_free = blocks[0]
    with pytest.raises(AssertionError, match="block 2 has a wrong back link"):
        queue.check_integrity()


def test_check_integrity_reports_a_wrong_count():
    queue, _ = make_queue(3)
    queue.num_free = 2
    with pytest.raises(AssertionError, match="more than num_free=2"):
        queue.check_integrity()


def test_check_integrity_reports_a_cycle_as_a_block_seen_twice():
    queue, blocks = make_queue(3)
    queue.num_free = 10
    blocks[2].next_free = blocks[0]
    with pytest.raises(AssertionError, match="block 0 is twice in the free queue"):
        queue.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["popleft", "append", "remove"]), st.integers(0, 7)), max_size=60)


@given(ops)
def test_matches_a_list_model(operations):
    """Against a plain list: same order after any mix of popleft, append and remove."""
    queue, blocks = make_queue(8)
    model = list(range(8))
    for op, block_id in operations:
        if op == "popleft" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "append" and block_id not in model:
            queue.append(blocks[block_id])
            model.append(block_id)
        elif op == "remove" and block_id in model:
            queue.remove(blocks[block_id])
            model.remove(block_id)
        assert queue.block_ids() == model
        queue.check_integrity()
