"""block_map: one byte a block (refcount, cached flag), keyed by worker id."""

from __future__ import annotations

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.services.kvstore.block_map import CACHED, REF_MAX, block_map, block_states, summarize

BLOCK = 4


def _manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, enable_prefix_caching=True, watermark=0.0, hash_keys=("m",))


def test_a_fresh_pool_is_all_free():
    manager = _manager()
    assert block_states(manager.pool.blocks) == bytes(8)
    assert summarize(bytes(8)) == {"free": 8, "cached": 0, "in_use": 0, "shared": 0}


def test_states_show_in_use_shared_and_cached_free_blocks():
    manager = _manager()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert manager.admit("a", len(prompt), len(prompt), prompt) == ([0, 1, 2], 0)
    manager.fork("a", ["a0", "a1"])  # each block now held twice
    assert block_states(manager.pool.blocks) == bytes([2 | CACHED, 2 | CACHED, 2, 0, 0, 0, 0, 0])
    manager.free("a0")
    manager.free("a1")
    manager.check_integrity()
    states = block_states(manager.pool.blocks)
    assert states == bytes([CACHED, CACHED, 0, 0, 0, 0, 0, 0])  # the full blocks stay cached
    assert summarize(states) == {"free": 6, "cached": 2, "in_use": 0, "shared": 0}
    assert summarize(bytes([1, 1 | CACHED, 3])) == {"free": 0, "cached": 0, "in_use": 2, "shared": 1}


def test_refcounts_are_capped():
    manager = _manager(2)
    manager.allocate_slots("p", 1)
    manager.fork("p", [f"c{i}" for i in range(200)])
    assert block_states(manager.pool.blocks) == bytes([REF_MAX, 0])


def test_the_map_is_keyed_by_worker():
    one, two = _manager(3), _manager(5)
    one.allocate_slots("r", BLOCK + 1)
    assert block_map({0: one, "w1": two, 7: None}) == {"workers": {
        "0": {"num_blocks": 3, "block_size": BLOCK, "states": bytes([1, 1, 0])},
        "w1": {"num_blocks": 5, "block_size": BLOCK, "states": bytes(5)}}}
