"""One worker pool's view of the shared offload tier: which admitted blocks to load, which newly
full blocks to store, and the pins that keep a block in the tier while a worker may read it.

A request's pins end when it frees its blocks, unless that comes so soon after its admission that
the step that loads them may still run (steps run in order, at most STEPS_IN_FLIGHT behind the
kvstore): then at the first step after that one. A block read anyway after its eviction is only
computed instead (the worker's fallback), so this bounds work, not correctness. A block to store is
a reservation until the worker's result says it is written (confirm()); one not confirmed within
PENDING_STEPS steps of this pool is dropped, so no request ever loads a block before its bytes.
A fill (a block full before its last token reaches here: async scheduling) is hashed and written by the
worker; it is reserved once hashed here or indexed once the worker names it, whichever comes first."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.services.kvstore.tier_index import TierIndex, TierKey

STEPS_IN_FLIGHT = 2  # plans the scheduler may have sent ahead of the step a worker runs
PENDING_STEPS = 16  # a confirmation takes about 3 steps (plan, write, result, next alloc)


class TierLink:
    def __init__(self, index: TierIndex, namespace: str, block_bytes: int) -> None:
        if not namespace or block_bytes < 1:
            raise ValueError(f"a tier link needs a namespace and a block size in bytes, got "
                             f"{namespace!r}, {block_bytes}")
        self.index, self.namespace, self.block_bytes = index, namespace, block_bytes
        self._step = 0  # steps begun
        self._pins: dict[str, tuple[int, list[TierKey]]] = {}  # request id -> (step admitted, entries it loads)
        self._released: list[tuple[int, list[TierKey]]] = []  # freed: (first step they may be unpinned, entries)
        self._stores: list[tuple[str, int, bytes]] = []  # (request id, block index, hash) to write
        self._reserved: dict[TierKey, int] = {}  # stores planned, not confirmed: key -> step, oldest first
        self._fills: list[tuple[str, int, bytes]] = []  # (request id, block index, parent hash) to hash and write
        self._filling: dict[tuple[str, int], int] = {}  # fills planned, not named: (request id, index) -> step
        self.num_hit_blocks = 0  # blocks admitted from the tier (loads planned)
        self.num_stored_blocks = 0  # blocks this pool was told to write

    def key(self, block_hash: bytes) -> TierKey:
        return self.namespace, block_hash

    def num_hits(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes the tier holds."""
        for count, block_hash in enumerate(block_hashes):
            if self.key(block_hash) not in self.index:
                return count
        return len(block_hashes)

    def pin(self, request_id: str, block_hashes: Sequence[bytes]) -> None:
        keys = [self.key(h) for h in block_hashes]
        for key in keys:
            self.index.pin(key)
        self._pins[request_id] = (self._step, keys)
        self.num_hit_blocks += len(keys)

    def on_hashed(self, request_id: str, block_index: int, block_hash: bytes) -> None:
        """A block became full and hashed in this pool: the worker writes it unless the tier has it (or a fill)."""
        key = self.key(block_hash)
        if key in self.index:
            self.index.insert(key, self.block_bytes)  # a touch
        elif self.index.reserve(key, self.block_bytes, self):
            self._reserved.pop(key, None)
            self._reserved[key] = self._step
            if (request_id, block_index) not in self._filling:
                self._stores.append((request_id, block_index, block_hash))
                self.num_stored_blocks += 1

    def on_filled(self, request_id: str, block_index: int, parent_hash: bytes) -> None:
        if (request_id, block_index) not in self._filling:
            self._filling[(request_id, block_index)] = self._step
            self._fills.append((request_id, block_index, parent_hash))
            self.num_stored_blocks += 1

    def confirm(self, block_hashes: Sequence[bytes]) -> None:
        for block_hash in block_hashes:
            key = self.key(block_hash)
            self.index.confirm(key, self)
            self._reserved.pop(key, None)

    def confirm_filled(self, filled: Sequence[tuple[str, int, bytes]]) -> None:
        """(request id, index, hash) the worker wrote; one not planned here or without room is deleted."""
        for request_id, block_index, block_hash in filled:
            key = self.key(block_hash)
            planned = self._filling.pop((request_id, block_index), None) is not None
            if planned and key not in self.index and not self.index.is_pending(key):
                if self.index.insert(key, self.block_bytes):
                    continue
            self.index.confirm(key, self)
            self._reserved.pop(key, None)

    def free(self, request_id: str) -> None:
        unrun = [(rid, index) for rid, index, _parent in self._fills if rid == request_id]
        for name in unrun:
            self._filling.pop(name, None)
        if unrun:
            self._fills = [fill for fill in self._fills if fill[0] != request_id]
        admitted, keys = self._pins.pop(request_id, (0, []))
        safe_from = admitted + STEPS_IN_FLIGHT + 1
        if self._step >= safe_from:
            self._unpin(keys)
        elif keys:
            self._released.append((safe_from, keys))

    def begin_step(self) -> None:
        """Unpin what freed requests loaded in steps that have run by now."""
        self._step += 1
        due = [keys for safe_from, keys in self._released if safe_from <= self._step]
        self._released = [(safe_from, keys) for safe_from, keys in self._released if safe_from > self._step]
        for keys in due:
            self._unpin(keys)
        while self._reserved:
            key, step = next(iter(self._reserved.items()))
            if step + PENDING_STEPS > self._step:
                break
            del self._reserved[key]
            self.index.cancel(key, self)
        while self._filling:
            name, step = next(iter(self._filling.items()))
            if step + PENDING_STEPS > self._step:
                break
            del self._filling[name]

    def _unpin(self, keys: list[TierKey]) -> None:
        for key in keys:
            self.index.unpin(key)

    def take_stores(self) -> list[tuple[str, int, bytes]]:
        stores, self._stores = self._stores, []
        return stores

    def take_fills(self) -> list[tuple[str, int, bytes]]:
        fills, self._fills = self._fills, []
        return fills

    def release_all(self) -> None:
        """The pool is gone (worker dropped or reset): every pin ends."""
        for _admitted, keys in [*self._pins.values(), *self._released]:
            self._unpin(keys)
        for key in self._reserved:
            self.index.cancel(key, self)
        self._pins.clear()
        self._released.clear()
        self._stores.clear()
        self._reserved.clear()
        self._fills.clear()
        self._filling.clear()

    def reserved(self) -> set[TierKey]:
        return set(self._reserved)

    def num_pins(self) -> int:
        return sum(len(keys) for _step, keys in [*self._pins.values(), *self._released])
