"""The offload tier's index (services/kvstore/tier_index.py): LRU order within a byte budget,
pinned entries never evicted, evicted keys handed out once, reservations neither readable nor
evictable until their owner confirms them; hypothesis against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedserve.services.kvstore.tier_index import TierIndex

OWNERS = ("w1", "w2")


def key(n: int) -> tuple[str, bytes]:
    return "ns", bytes([n])


def test_inserts_evict_the_least_recently_used_unpinned_entries():
    tier = TierIndex(30)
    for n in range(3):
        assert tier.insert(key(n), 10)
    tier.insert(key(0), 10)  # a touch: 0 is now the most recently used
    tier.pin(key(1))
    assert tier.insert(key(3), 10)
    assert tier.keys() == [key(0), key(1), key(3)]  # 2 evicted: 1 is pinned (and pinning touched it)
    assert tier.take_evicted() == [key(2)] and tier.take_evicted() == []
    assert not tier.insert(key(4), 25)  # 0 and 3 give 20 bytes: not enough, nothing changes
    assert (tier.keys(), tier.num_refused, tier.used_bytes) == ([key(0), key(1), key(3)], 1, 30)
    tier.unpin(key(1))
    assert tier.insert(key(4), 25)
    assert tier.keys() == [key(4)] and tier.take_evicted() == [key(0), key(1), key(3)]
    tier.check_integrity()


def test_clear_keeps_pinned_entries_and_a_stored_again_key_is_not_deleted():
    tier = TierIndex(100)
    for n in range(3):
        tier.insert(key(n), 10)
    tier.pin(key(2))
    assert tier.clear() == 2 and tier.keys() == [key(2)]
    tier.insert(key(0), 10)  # stored again before the loop deleted the old contents
    assert tier.take_evicted() == [key(1)]
    with pytest.raises(ValueError):
        tier.unpin(key(0))
    tier.check_integrity()


def test_take_touched_lists_the_uses_since_the_last_call_least_recent_first():
    tier = TierIndex(30)
    for n in range(3):
        tier.insert(key(n), 10)
    assert tier.take_touched() == [key(0), key(1), key(2)] and tier.take_touched() == []
    tier.pin(key(0))
    tier.insert(key(1), 10)  # a touch
    tier.insert(key(3), 10)  # evicts 2, the least recently used unpinned entry
    assert tier.take_touched() == [key(0), key(1), key(3)]
    assert tier.keys() == [key(0), key(1), key(3)]
    tier.insert(key(4), 10)  # evicts 1 (0 is pinned): what was touched and then evicted is not listed
    tier.insert(key(4), 10)
    assert tier.take_touched() == [key(4)] and tier.take_evicted() == [key(2), key(1)]
    tier.check_integrity()


def test_a_reservation_holds_room_but_is_neither_readable_nor_evicted_until_confirmed():
    tier = TierIndex(30)
    tier.insert(key(0), 10)
    assert tier.reserve(key(1), 10, "w1") and not tier.reserve(key(1), 10, "w2")
    assert not tier.reserve(key(0), 10, "w1")  # readable already
    assert key(1) not in tier and tier.is_pending(key(1)) and not tier.insert(key(1), 10)
    assert tier.take_events() == ([key(0)[1]], [])  # the router hears of a block once it is loadable
    assert tier.insert(key(2), 20)  # evicts 0, never the reservation
    assert tier.take_evicted() == [key(0)]
    tier.pin(key(2))
    assert not tier.insert(key(3), 10) and tier.num_refused == 1  # only the reservation is left to evict
    tier.unpin(key(2))
    assert not tier.confirm(key(1), "w2") and tier.is_pending(key(1))  # only the owner's write counts
    assert tier.confirm(key(1), "w1") and key(1) in tier and tier.keys() == [key(2), key(1)]
    assert tier.take_events() == ([key(2)[1], key(1)[1]], [key(0)[1]])
    tier.check_integrity()


def test_a_cancelled_reservation_and_a_late_write_are_deleted():
    tier = TierIndex(30)
    assert tier.reserve(key(0), 10, "w1") and tier.reserve(key(1), 10, "w1")
    assert tier.cancel(key(0), "w1") and not tier.cancel(key(1), "w2") and not tier.cancel(key(0), "w1")
    assert tier.take_evicted() == [key(0)] and tier.used_bytes == 10 and tier.num_cancelled == 1
    assert not tier.confirm(key(0), "w1")  # written after all: nobody reserves it now
    assert tier.take_evicted() == [key(0)] and key(0) not in tier
    assert tier.clear() == 0 and not tier.is_pending(key(1)) and tier.take_evicted() == [key(1)]
    tier.check_integrity()


class TierMachine(RuleBasedStateMachine):
    """The model: an LRU list (least recent first), sizes, reader counts, deleted keys."""

    @initialize(capacity=st.integers(1, 60))
    def setup(self, capacity):
        self.tier = TierIndex(capacity)
        self.capacity = capacity
        self.order: list[tuple[str, bytes]] = []
        self.sizes: dict[tuple[str, bytes], int] = {}
        self.readers: dict[tuple[str, bytes], int] = {}
        self.pending: list[tuple[str, bytes]] = []  # deleted (evicted), not taken yet
        self.reserved: dict[tuple[str, bytes], tuple[int, str]] = {}  # key -> (size, owner)
        self.touched: list[tuple[str, bytes]] = []  # since take_touched(), least recent first

    def touch(self, k):
        if k in self.touched:
            self.touched.remove(k)
        self.touched.append(k)

    def forget(self, k):
        self.order.remove(k)
        del self.sizes[k], self.readers[k]
        self.pending.append(k)
        if k in self.touched:
            self.touched.remove(k)

    def make_room(self, size) -> bool:
        free = self.capacity - sum(self.sizes.values()) - sum(n for n, _o in self.reserved.values())
        victims = []
        for v in self.order:
            if free >= size:
                break
            if self.readers[v] == 0:
                victims.append(v)
                free += self.sizes[v]
        if free < size:
            return False
        for v in victims:
            self.forget(v)
        return True

    def add(self, k, size):
        if k in self.pending:
            self.pending.remove(k)
        self.order.append(k)
        self.sizes[k], self.readers[k] = size, 0
        self.touch(k)

    @rule(n=st.integers(0, 7), size=st.integers(1, 25))
    def insert(self, n, size):
        k = key(n)
        if k in self.sizes:
            assert self.tier.insert(k, size)
            self.order.remove(k)
            self.order.append(k)
            self.touch(k)
            return
        ok = k not in self.reserved and self.make_room(size)
        assert self.tier.insert(k, size) == ok
        if ok:
            self.add(k, size)

    @rule(n=st.integers(0, 7), size=st.integers(1, 25), owner=st.sampled_from(OWNERS))
    def reserve(self, n, size, owner):
        k = key(n)
        ok = k not in self.sizes and k not in self.reserved and self.make_room(size)
        assert self.tier.reserve(k, size, owner) == ok
        if ok:
            if k in self.pending:
                self.pending.remove(k)
            self.reserved[k] = (size, owner)
        assert k not in self.tier or k in self.sizes  # a reservation is never readable

    @rule(n=st.integers(0, 7), owner=st.sampled_from(OWNERS), write=st.booleans())
    def end_reservation(self, n, owner, write):
        """The owner's write confirmed (write) or given up; another's changes nothing."""
        k = key(n)
        ok = self.reserved.get(k, (0, None))[1] is owner
        assert (self.tier.confirm if write else self.tier.cancel)(k, owner) == ok
        size = self.reserved.pop(k)[0] if ok else 0
        if ok and write:
            self.add(k, size)
        elif ok or (write and k not in self.reserved and k not in self.sizes and k not in self.pending):
            self.pending.append(k)  # deleted: it may have been written, and nobody reserves it now

    @rule(n=st.integers(0, 7))
    def pin(self, n):
        k = key(n)
        if k in self.reserved:
            with pytest.raises(KeyError):  # nobody loads a block before its bytes are written
                self.tier.pin(k)
        if k in self.sizes:
            self.tier.pin(k)
            self.readers[k] += 1
            self.order.remove(k)
            self.order.append(k)
            self.touch(k)

    @rule(n=st.integers(0, 7))
    def unpin(self, n):
        k = key(n)
        if self.readers.get(k, 0) > 0:
            self.tier.unpin(k)
            self.readers[k] -= 1
        else:
            with pytest.raises(ValueError):
                self.tier.unpin(k)

    @rule()
    def clear(self):
        victims = [k for k in self.order if self.readers[k] == 0]
        assert self.tier.clear() == len(victims)
        for v in victims:
            self.forget(v)
        self.pending += list(self.reserved)
        self.reserved = {}

    @rule()
    def take_touched(self):
        assert self.tier.take_touched() == self.touched
        self.touched = []

    @rule()
    def take_evicted(self):
        assert sorted(self.tier.take_evicted()) == sorted(self.pending)
        self.pending = []

    @invariant()
    def agrees(self):
        self.tier.check_integrity()
        assert self.tier.keys() == self.order  # LRU order
        reserved = sum(n for n, _o in self.reserved.values())
        assert self.tier.used_bytes == sum(self.sizes.values()) + reserved <= self.capacity
        assert all(self.tier.readers(k) == r for k, r in self.readers.items())
        # no entry both held and free: a pinned entry is never among the deleted
        assert not set(self.pending) & set(self.sizes)
        # no block both reserved and readable, and a reservation is never pinned
        assert self.tier.pending_owners() == {k: o for k, (_n, o) in self.reserved.items()}
        assert not any(k in self.tier for k in self.reserved) and not set(self.reserved) & set(self.pending)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
