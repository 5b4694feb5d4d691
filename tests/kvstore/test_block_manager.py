"""The fine-grained API: block tables, slot counting, tail-first frees, the leak check."""

import pytest

from pagedserve.services.kvstore.block_manager import BlockManager
from tests.kvstore.factories import make_manager


def test_first_allocations_get_block_ids_in_order():
    manager = make_manager(num_blocks=8, block_size=4)
    assert manager.allocate_slots("a", 5) == [0, 1]
    assert manager.allocate_slots("b", 4) == [2]
    assert manager.allocate_slots("c", 1) == [3]
    assert manager.get_block_ids("a") == [0, 1]
    assert (manager.num_free_blocks, manager.num_held_blocks, manager.usage) == (4, 4, 0.5)
    manager.check_integrity()


def test_a_new_block_only_when_the_last_one_is_full():
    manager = make_manager(block_size=4)
    assert manager.allocate_slots("a", 5) == [0, 1]
    assert manager.allocate_slots("a", 3) == []  # 8 tokens: blocks 0 and 1 are full
    assert manager.allocate_slots("a", 1) == [2]
    assert manager.allocate_slots("a", 0) == []
    assert manager.get_block_ids("a") == [0, 1, 2]
    manager.check_integrity()


def test_num_blocks_needed_and_can_allocate():
    manager = make_manager(num_blocks=3, block_size=4)
    assert manager.num_blocks_needed("a", 9) == 3  # unknown request: from nothing
    manager.allocate_slots("a", 6)
    assert manager.num_blocks_needed("a", 8) == 0
    assert manager.num_blocks_needed("a", 9) == 1
    assert manager.num_blocks_needed("a", 3) == 0
    assert manager.can_allocate("a", 6)  # 12 tokens: one more block, one is free
    assert not manager.can_allocate("a", 7)
    assert not manager.can_allocate("b", 5)


def test_allocate_slots_without_room_returns_none_and_changes_nothing():
    manager = make_manager(num_blocks=3, block_size=4)
    manager.allocate_slots("a", 8)
    assert manager.allocate_slots("a", 5) is None
    assert manager.allocate_slots("b", 5) is None
    assert manager.get_block_ids("a") == [0, 1]
    assert manager.get_block_ids("b") == [] and not manager.has_request("b")
    assert manager.allocate_slots("a", 4) == [2]  # 12 tokens: still counted from 8
    manager.check_integrity()


def test_negative_token_count_is_refused():
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        make_manager().allocate_slots("a", -1)


def test_free_returns_blocks_tail_first_to_the_end_of_the_queue():
    manager = make_manager(num_blocks=6, block_size=4)
    manager.allocate_slots("a", 12)  # [0, 1, 2]
    manager.allocate_slots("b", 4)  # [3]
    manager.free("a")
    assert manager.pool.free_queue.block_ids() == [4, 5, 2, 1, 0]
    assert manager.get_block_ids("a") == []
    assert manager.allocate_slots("c", 12) == [4, 5, 2]
    assert manager.allocate_slots("d", 8) == [1, 0]
    manager.check_integrity()


def test_free_of_an_unknown_id_is_a_no_op_and_an_id_can_be_reused():
    manager = make_manager(num_blocks=4)
    manager.allocate_slots("a", 4)
    manager.free("nobody")
    manager.free("a")
    manager.free("a")
    assert manager.num_free_blocks == 4
    assert manager.allocate_slots("a", 4) == [1]  # a fresh table; 0 went to the queue's end
    manager.check_integrity()


def test_stats_count_the_pool():
    manager = make_manager(num_blocks=4, block_size=4)
    manager.allocate_slots("a", 5)
    manager.preempt("a")
    manager.allocate_slots("b", 1)
    assert manager.stats() == {
        "num_blocks": 4, "num_free_blocks": 3, "num_held_blocks": 1, "usage": 0.25,
        "num_cached_blocks": 0, "num_cached_free_blocks": 0, "prefix_caching": False,
        "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0,
        "num_preemptions": 1, "num_evictions": 0, "num_block_copies": 0, "num_prefix_cache_resets": 0,
        "prefix_cache_tier_hits": 0,
    }


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0}, "num_blocks must be >= 1"),
    ({"num_blocks": 4, "block_size": 0}, "block_size must be >= 1"),
    ({"num_blocks": 4, "watermark": 1.0}, "watermark must be in"),
])
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_watermark_is_rounded_up_to_whole_blocks():
    assert BlockManager(100).watermark_blocks == 1  # default 1%
    assert BlockManager(101).watermark_blocks == 2
    assert BlockManager(10, watermark=0.0).watermark_blocks == 0


def test_check_integrity_reports_a_refcount_that_disagrees_with_the_tables():
    manager = make_manager()
    manager.allocate_slots("a", 8)
    manager.pool.blocks[1].ref_cnt = 2
    with pytest.raises(AssertionError, match="block 1 has ref_cnt 2 but 1 block-table references"):
        manager.check_integrity()


def test_check_integrity_reports_a_held_block_in_the_free_queue():
    manager = make_manager()
    manager.allocate_slots("a", 4)
    manager.pool.free_queue.append(manager.pool.blocks[0])
    with pytest.raises(AssertionError, match="block 0 ref_cnt=1 but in_free_queue=True"):
        manager.check_integrity()


def test_check_integrity_reports_a_leaked_block():
    manager = make_manager()
    manager.allocate_slots("a", 4)
    del manager._tables["a"]  # dropped without freeing: the block is lost
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 1 but 0 block-table references"):
        manager.check_integrity()


def test_check_integrity_reports_a_table_with_too_few_blocks():
    manager = make_manager(block_size=4)
    manager.allocate_slots("a", 4)
    manager._tables["a"].num_tokens = 5
    with pytest.raises(AssertionError, match="'a' has 1 blocks for 5 tokens"):
        manager.check_integrity()


def test_check_integrity_reports_a_hash_entry_pointing_to_the_wrong_block():
    manager = make_manager(prefix=True)
    manager.pool.cached_blocks[b"h" * 32] = manager.pool.blocks[3]
    with pytest.raises(AssertionError, match="points to block 3 whose block_hash is None"):
        manager.check_integrity()
