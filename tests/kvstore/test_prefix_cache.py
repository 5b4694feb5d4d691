"""Prefix caching: chained block hashes, shared full blocks, LRU eviction of free cached ones."""

import hashlib
import struct

from pagedserve.services.kvstore.block_manager import BlockManager
from pagedserve.shared.block_hash import ROOT_HASH, hash_block, hash_full_blocks, root_hash
from pagedserve.shared.messages import ALLOC_OK, ALLOC_PREEMPTED
from tests.kvstore.factories import make_manager, prompt, running, statuses, step, waiting


def test_block_hash_is_sha256_of_parent_and_little_endian_token_ids():
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<3I", 1, 2, 70000)).digest()
    assert hash_block(ROOT_HASH, [1, 2, 70000]) == expected


def test_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    first, second = hash_full_blocks([1, 1, 2, 2, 3], block_size=2)  # the partial [3] has none
    assert hash_full_blocks([1, 1, 2, 2], 2) == [first, second]
    assert hash_full_blocks([9, 9, 2, 2], 2)[1] != second
    assert second == hash_block(first, [2, 2])


def test_a_second_request_with_the_same_prompt_shares_its_full_blocks():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    tokens = prompt(1, 2, extra=2)  # 10 tokens: 2 full blocks and a partial one
    assert statuses(step(manager, waiting("a", 10, token_ids=tokens))) == [("a", ALLOC_OK, [0, 1, 2])]
    reply = step(manager, waiting("b", 10, token_ids=tokens))
    # the full blocks 0 and 1 are shared; the partial last block is never shared
    assert statuses(reply) == [("b", ALLOC_OK, [0, 1, 3])]
    assert reply.results[0].num_cached_tokens == 8
    assert [manager.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    stats = manager.stats()
    assert (stats["num_cached_blocks"], stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (2, 20, 8)


def test_the_last_token_is_always_left_to_compute():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    tokens = prompt(1, 2)  # exactly 2 full blocks
    step(manager, waiting("a", 8, token_ids=tokens))
    reply = step(manager, waiting("b", 8, token_ids=tokens))
    # only block 0 is a hit: block 1 holds the last token, which b must compute itself
    assert statuses(reply) == [("b", ALLOC_OK, [0, 2])]
    assert reply.results[0].num_cached_tokens == 4
    assert manager.pool.blocks[2].block_hash is None  # a duplicate of block 1 stays unhashed
    manager.check_integrity()


def test_a_miss_and_a_divergence_part_way():
    manager = make_manager(num_blocks=12, block_size=4, prefix=True)
    step(manager, waiting("a", 13, token_ids=prompt(1, 2, 3, extra=1)))  # [0, 1, 2, 3]
    miss = step(manager, waiting("b", 9, token_ids=prompt(7, 2, extra=1)))
    assert statuses(miss) == [("b", ALLOC_OK, [4, 5, 6])]
    assert miss.results[0].num_cached_tokens == 0
    part = step(manager, waiting("c", 13, token_ids=prompt(1, 2, 7, extra=1)))
    assert statuses(part) == [("c", ALLOC_OK, [0, 1, 7, 8])]
    assert part.results[0].num_cached_tokens == 8


def test_a_freed_request_leaves_its_blocks_cached_until_they_are_reused():
    manager = make_manager(num_blocks=6, block_size=4, prefix=True)
    tokens = prompt(1, 2, 3)
    step(manager, waiting("a", 12, token_ids=tokens))  # [0, 1, 2], all three full and hashed
    step(manager, free=("a",))
    assert manager.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert manager.stats()["num_cached_blocks"] == 3
    reply = step(manager, waiting("b", 12, token_ids=tokens))
    # blocks 0 and 1 come back out of the middle of the free queue; block 2 is recomputed
    assert statuses(reply) == [("b", ALLOC_OK, [0, 1, 3])]
    assert manager.pool.free_queue.block_ids() == [4, 5, 2]


def test_eviction_takes_the_least_recently_freed_first_and_a_chain_from_its_end():
    manager = make_manager(num_blocks=6, block_size=4, prefix=True)
    tokens = prompt(1, 2, 3)
    step(manager, waiting("a", 12, token_ids=tokens))  # [0, 1, 2]
    step(manager, free=("a",))  # free queue: 3, 4, 5, 2, 1, 0
    assert manager.allocate_slots("x", 16) == [3, 4, 5, 2]  # evicts the chain's last block
    assert manager.stats()["num_evictions"] == 1
    assert manager.pool.blocks[2].block_hash is None
    reply = step(manager, waiting("b", 13, token_ids=tokens + [5]), free=("x",))
    # x freed tail first behind 1, 0: the queue was 1, 0, 2, 5, 4, 3. Blocks 0 and 1 still
    # hit; the third block's prefix was evicted, so b recomputes it in fresh blocks 2 and 5
    assert statuses(reply) == [("b", ALLOC_OK, [0, 1, 2, 5])]
    assert reply.results[0].num_cached_tokens == 8
    manager.check_integrity()


def test_hits_on_held_blocks_do_not_count_against_the_free_pool():
    manager = make_manager(num_blocks=4, block_size=4, prefix=True)
    tokens = prompt(1, 2, 3)
    step(manager, waiting("a", 12, token_ids=tokens))  # holds [0, 1, 2], one block free
    reply = step(manager, waiting("b", 16, token_ids=tokens + [7, 7, 7, 7]))
    # 4 blocks in all, 3 of them hits on held blocks: the one free block suffices
    assert statuses(reply) == [("b", ALLOC_OK, [0, 1, 2, 3])]
    assert reply.results[0].num_cached_tokens == 12


def test_a_hit_on_a_free_cached_block_counts_against_the_free_pool():
    manager = make_manager(num_blocks=4, block_size=4, prefix=True)
    step(manager, waiting("a", 8, token_ids=prompt(1, 2)))  # [0, 1]
    step(manager, free=("a",))
    step(manager, waiting("x", 4, token_ids=prompt(5)))  # takes block 2; 3, 1, 0 free
    # b hits block 0 (free), needs 3 more; 3 free minus the hit leaves 2: refused
    reply = step(manager, waiting("b", 16, token_ids=prompt(1, 6, 6, 6)))
    assert reply.results[0].status == "not_admitted"
    assert manager.pool.free_queue.block_ids() == [3, 1, 0]


def test_a_block_is_hashed_once_the_step_that_fills_it_is_allocated():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    tokens = prompt(1, 2, 3)
    step(manager, waiting("a", 12, num_new_tokens=5, token_ids=tokens))  # [0, 1]: block 0 full
    assert manager.stats()["num_cached_blocks"] == 1
    reply = step(manager, running("a", 7), waiting("b", 12, token_ids=tokens))
    # a fills blocks 1 and 2 in this step, and b already hits block 1: the worker writes
    # every new K/V of a layer before any attention reads them
    assert statuses(reply) == [("a", ALLOC_OK, [2]), ("b", ALLOC_OK, [0, 1, 3])]
    assert reply.results[1].num_cached_tokens == 8
    assert manager.stats()["num_cached_blocks"] == 3


def decode(request_id: str, token_id: int):
    candidate = running(request_id, 1)
    candidate.token_ids = [token_id]
    return candidate


def test_a_block_of_generated_tokens_is_hashed_as_soon_as_it_fills():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("a", 3, token_ids=[1, 1, 1]))  # [0]
    step(manager, decode("a", 4))  # the decode's token (position 3) fills block 0
    assert manager.stats()["num_cached_blocks"] == 1
    reply = step(manager, waiting("b", 5, token_ids=[1, 1, 1, 4, 5]))
    assert statuses(reply) == [("b", ALLOC_OK, [0, 1])] and reply.results[0].num_cached_tokens == 4


def test_tokens_the_kvstore_was_never_told_are_not_hashed_until_a_resume():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    step(manager, waiting("a", 3, token_ids=[1, 1, 1]))
    step(manager, running("a", 1))  # a decode without its token: a gap, hashing stops
    step(manager, decode("a", 5))
    assert manager.stats()["num_cached_blocks"] == 0
    step(manager, free=("a",))
    reply = step(manager, waiting("a", 5, token_ids=[1, 1, 1, 4, 5]))  # resumed with all its tokens
    assert statuses(reply) == [("a", ALLOC_OK, [2, 3])]  # [0, 1] went to the queue's end
    assert manager.stats()["num_cached_blocks"] == 1


def test_a_preempted_request_keeps_its_full_blocks_cached_and_resumes_on_a_hit():
    manager = make_manager(num_blocks=4, block_size=4, prefix=True)
    step(manager, waiting("a", 6, token_ids=prompt(1, extra=2)))  # [0, 1]
    step(manager, waiting("b", 4, token_ids=prompt(2)))  # [2]
    step(manager, decode("a", 7))
    step(manager, decode("a", 8))  # a's block 1 = [900, 901, 7, 8] is full and hashed
    reply = step(manager, decode("b", 9), running("a", 5))  # a wants 2 more blocks: only 1 free
    assert statuses(reply) == [("b", ALLOC_OK, [3]), ("a", ALLOC_PREEMPTED, [])]
    assert manager.pool.free_queue.block_ids() == [1, 0]  # freed tail first, still cached
    resumed = step(manager, waiting("a", 9, token_ids=prompt(1, extra=2) + [7, 8, 6]), free=("b",))
    assert statuses(resumed) == [("a", ALLOC_OK, [0, 1, 3])]
    assert resumed.results[0].num_cached_tokens == 8  # all but the token after the preemption


def test_cached_free_blocks_are_evicted_before_anyone_is_preempted():
    manager = make_manager(num_blocks=4, block_size=4, prefix=True)
    step(manager, waiting("old", 8, token_ids=prompt(5, 6)))  # [0, 1]
    step(manager, free=("old",))  # both cached and free: queue 2, 3, 1, 0
    step(manager, waiting("a", 4, token_ids=prompt(1)))  # [2]
    assert manager.stats()["num_cached_free_blocks"] == 2
    reply = step(manager, running("a", 12))  # 3 more blocks: the free one and both cached ones
    assert statuses(reply) == [("a", ALLOC_OK, [3, 1, 0])]
    assert (manager.num_preemptions, manager.stats()["num_evictions"]) == (0, 2)
    assert manager.stats()["num_cached_free_blocks"] == 0


def test_the_model_and_the_cache_salt_key_the_hash():
    assert root_hash(()) == ROOT_HASH and root_hash(("", "")) == ROOT_HASH
    assert len({root_hash(("ab", "c")), root_hash(("a", "bc")), root_hash(("ab",))}) == 3
    manager = BlockManager(8, 4, enable_prefix_caching=True, watermark=0.0, hash_keys=("smollm2",))
    tokens = prompt(1, 2, extra=1)
    step(manager, waiting("a", 9, token_ids=tokens))  # [0, 1, 2]
    salted = waiting("b", 9, token_ids=tokens)
    salted.cache_salt = "tenant-b"
    assert statuses(step(manager, salted)) == [("b", ALLOC_OK, [3, 4, 5])]  # a miss: another salt
    expected = hash_full_blocks(tokens, 4, root_hash(("smollm2",)))
    assert manager.pool.blocks[0].block_hash == expected[0] != hash_full_blocks(tokens, 4)[0]
    again = step(manager, waiting("c", 9, token_ids=tokens))
    assert statuses(again) == [("c", ALLOC_OK, [0, 1, 6])]


def test_a_reset_forgets_every_cached_prefix():
    manager = make_manager(num_blocks=8, block_size=4, prefix=True)
    tokens = prompt(1, 2, extra=1)
    step(manager, waiting("a", 9, token_ids=tokens))  # [0, 1, 2]; "1" and "2" cached
    step(manager, waiting("b", 4, token_ids=prompt(3)))  # [3]
    step(manager, free=("b",))
    assert manager.reset_prefix_cache() == 3
    manager.check_integrity()
    stats = manager.stats()
    assert (stats["num_cached_blocks"], stats["num_cached_free_blocks"], stats["num_prefix_cache_resets"]) == (0, 0, 1)
    reply = step(manager, waiting("c", 9, token_ids=tokens))
    assert statuses(reply) == [("c", ALLOC_OK, [4, 5, 6])] and reply.results[0].num_cached_tokens == 0


def test_without_prefix_caching_nothing_is_hashed_or_shared():
    manager = make_manager(num_blocks=8, block_size=4, prefix=False)
    tokens = prompt(1, 2, extra=1)
    step(manager, waiting("a", 9, token_ids=tokens))
    reply = step(manager, waiting("b", 9, token_ids=tokens))
    assert statuses(reply) == [("b", ALLOC_OK, [3, 4, 5])]
    assert reply.results[0].num_cached_tokens == 0
    stats = manager.stats()
    assert (stats["num_cached_blocks"], stats["prefix_cache_queries"]) == (0, 0)


def test_freeing_a_shared_block_keeps_it_held_by_the_other_request():
    manager = make_manager(num_blocks=6, block_size=4, prefix=True)
    tokens = prompt(1, 2, extra=1)
    step(manager, waiting("a", 9, token_ids=tokens))  # [0, 1, 2]
    step(manager, waiting("b", 9, token_ids=tokens))  # [0, 1, 3]
    step(manager, free=("a",))
    assert manager.pool.free_queue.block_ids() == [4, 5, 2]  # only a's own partial block
    assert [manager.pool.blocks[i].ref_cnt for i in (0, 1)] == [1, 1]
    step(manager, free=("b",))
    assert manager.pool.free_queue.block_ids() == [4, 5, 2, 3, 1, 0]
