"""The offload tier's index (pure): which blocks the tier holds, in LRU order, within a byte budget.

Keys are (namespace, block hash) (shared.kv_tier). An entry is pinned while a worker may be
loading it (readers > 0) and is then never evicted; insert() and reserve() evict the least recently
used unpinned entries until the new one fits, or refuse it. A reservation (a store planned, not yet
written) holds its bytes, is neither readable nor evictable, and ends in confirm() or cancel(). Evicted keys wait in take_evicted() for
the loop to delete their contents; keys used since the last take_touched() wait there for the loop
to record their new place in the LRU order (so a restarted kvstore reads the order back).
Invariant: used_bytes = sum of entry sizes <= capacity_bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

TierKey = tuple[str, bytes]


@dataclass
class TierEntry:
    num_bytes: int
    readers: int = 0


class TierIndex:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[TierKey, TierEntry] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.num_pinned = 0  # entries with readers > 0
        self._evicted: dict[TierKey, None] = {}  # ordered set: deleted by the loop, unless stored again
        self.num_stored = 0  # entries ever inserted
        self.num_evicted = 0  # entries ever evicted for room (not counting clear())
        self.num_refused = 0  # inserts that found no room among unpinned entries
        self._events: dict[bytes, bool] = {}  # hash -> stored (True) or removed, net since take_events()
        self._touched: dict[TierKey, None] = {}  # ordered set, least recently used first: since take_touched()
        self._pending: dict[TierKey, tuple[int, object]] = {}  # reserved, not written yet: key -> (bytes, owner)
        self.num_cancelled = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: TierKey) -> bool:
        return key in self._entries

    def keys(self) -> list[TierKey]:
        """Least recently used first."""
        return list(self._entries)

    def is_pending(self, key: TierKey) -> bool:
        return key in self._pending

    def pending_owners(self) -> dict[TierKey, object]:
        return {key: owner for key, (_size, owner) in self._pending.items()}

    def readers(self, key: TierKey) -> int:
        entry = self._entries.get(key)
        return entry.readers if entry is not None else 0

    def insert(self, key: TierKey, num_bytes: int) -> bool:
        """Add (or touch) a readable entry; False, with nothing changed, if reserved or no room can be made."""
        if key in self._entries:
            self._touch(key)
            return True
        if key in self._pending or not self._make_room(num_bytes):
            return False
        self._add(key, num_bytes)
        return True

    def reserve(self, key: TierKey, num_bytes: int, owner: object) -> bool:
        if key in self._entries or key in self._pending or not self._make_room(num_bytes):
            return False
        self._evicted.pop(key, None)
        self._pending[key] = (num_bytes, owner)
        self.used_bytes += num_bytes
        return True

    def confirm(self, key: TierKey, owner: object) -> bool:
        """owner wrote the block it reserved: readable now. A write nobody reserves is deleted."""
        pending = self._pending.get(key)
        if pending is None or pending[1] is not owner:
            if pending is None and key not in self._entries:
                self._evicted[key] = None
            return False
        del self._pending[key]
        self.used_bytes -= pending[0]
        self._add(key, pending[0])
        return True

    def cancel(self, key: TierKey, owner: object) -> bool:
        pending = self._pending.get(key)
        if pending is None or pending[1] is not owner:
            return False
        del self._pending[key]
        self.used_bytes -= pending[0]
        self._evicted[key] = None
        self.num_cancelled += 1
        return True

    def _make_room(self, num_bytes: int) -> bool:
        if num_bytes < 1:
            raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
        victims: list[TierKey] = []
        room = self.capacity_bytes - self.used_bytes
        for victim, entry in self._entries.items():
            if room >= num_bytes:
                break
            if entry.readers == 0:
                victims.append(victim)
                room += entry.num_bytes
        if room < num_bytes:
            self.num_refused += 1
            return False
        for victim in victims:
            self._remove(victim)
            self.num_evicted += 1
        return True

    def _add(self, key: TierKey, num_bytes: int) -> None:
        self._evicted.pop(key, None)  # stored again before its old contents were deleted: keep them
        self._entries[key] = TierEntry(num_bytes)
        self._touch(key)
        self._events[key[1]] = True
        self.used_bytes += num_bytes
        self.num_stored += 1

    def pin(self, key: TierKey) -> None:
        """One more reader (a load planned); the entry becomes the most recently used."""
        entry = self._entries[key]
        entry.readers += 1
        self.num_pinned += entry.readers == 1
        self._touch(key)

    def unpin(self, key: TierKey) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.readers < 1:
            raise ValueError(f"unpin of a tier entry nobody reads: {key[1].hex()[:8]}")
        entry.readers -= 1
        self.num_pinned -= entry.readers == 0

    def clear(self) -> int:
        """Forget every unpinned entry and reservation (their contents are deleted too); how many entries."""
        victims = [key for key, entry in self._entries.items() if entry.readers == 0]
        for victim in victims:
            self._remove(victim)
        for key, (_size, owner) in list(self._pending.items()):
            self.cancel(key, owner)
        return len(victims)

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(hashes stored, hashes removed) since the last call, for the router's index."""
        events, self._events = self._events, {}
        return [h for h, stored in events.items() if stored], [h for h, stored in events.items() if not stored]

    def take_touched(self) -> list[TierKey]:
        """Entries stored or used since the last call, least recently used first (each now more
        recent than every entry not listed)."""
        touched, self._touched = list(self._touched), {}
        return touched

    def _touch(self, key: TierKey) -> None:
        self._entries.move_to_end(key)
        self._touched.pop(key, None)
        self._touched[key] = None

    def take_evicted(self) -> list[TierKey]:
        evicted, self._evicted = list(self._evicted), {}
        return evicted

    def _remove(self, key: TierKey) -> None:
        entry = self._entries.pop(key)
        self.used_bytes -= entry.num_bytes
        self._touched.pop(key, None)
        self._evicted[key] = None
        self._events[key[1]] = False

    def stats(self) -> dict:
        return {"tier_capacity_bytes": self.capacity_bytes, "tier_used_bytes": self.used_bytes,
                "tier_num_blocks": len(self._entries), "tier_num_pinned": self.num_pinned,
                "tier_num_pending": len(self._pending), "tier_num_cancelled": self.num_cancelled,
                "tier_usage": self.used_bytes / self.capacity_bytes, "tier_num_stored": self.num_stored,
                "tier_num_evicted": self.num_evicted, "tier_num_refused": self.num_refused}

    def check_integrity(self) -> None:
        held = sum(e.num_bytes for e in self._entries.values()) + sum(n for n, _o in self._pending.values())
        assert self.used_bytes == held, f"tier used_bytes={self.used_bytes}, its entries and reservations: {held}"
        assert self.used_bytes <= self.capacity_bytes, (
            f"tier holds {self.used_bytes} bytes over its budget of {self.capacity_bytes}")
        assert all(e.readers >= 0 and e.num_bytes > 0 for e in self._entries.values()), "tier entry out of range"
        num_pinned = sum(e.readers > 0 for e in self._entries.values())
        assert num_pinned == self.num_pinned, f"{num_pinned} tier entries are read but num_pinned={self.num_pinned}"
        deleting = set(self._evicted)
        assert not deleting & set(self._entries), "a tier entry is both held and waiting for deletion"
        assert not deleting & set(self._pending), "a tier reservation is waiting for deletion"
        assert not set(self._pending) & set(self._entries), "a tier block is both reserved and readable"
        assert set(self._touched) <= set(self._entries), "a touched tier key is not held"
        tail = list(self._entries)[len(self._entries) - len(self._touched):]
        assert tail == list(self._touched), "the touched tier keys are not the most recently used, in order"
