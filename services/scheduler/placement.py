"""Placement (no Redis): the worker a request is queued on, chosen once, as Dynamo's KV router does:
cost(w) = prefill_weight * (new(w) - (1 - TIER_LOAD_WEIGHT) * tier(w)) + decode_weight * (load(w) + new(w)),
new(w) = blocks not cached in w's pool, tier(w) = how many of those, in a row, the offload tier holds:
a block costs nothing in the worker's pool, a load from the tier, a prefill nowhere.

A block key is a chained prefix hash, so a worker's overlap is how many leading keys it holds; a stale
index costs a recompute, never a wrong answer. Placed keys count as predicted until events or a TTL.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.shared.messages import KEY_BYTES

PREDICTED_TTL_S = 30.0
PRUNE_EVERY = 4096  # predictions recorded between two sweeps of the expired ones
# a tier block's cost as a fraction of prefilling it: a load is one MGET and a copy of the block's
# bytes, a prefill the whole model over its 16 tokens (docs/benchmarks.md, issue 28)
TIER_LOAD_WEIGHT = 0.1


def split_keys(blob: bytes) -> list[bytes]:
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob) - KEY_BYTES + 1, KEY_BYTES)]


class PrefixIndex:
    """block key -> the workers holding that block cached (from KV events)."""

    def __init__(self) -> None:
        self._workers_of: dict[bytes, set[str]] = {}
        self._keys_of: dict[str, set[bytes]] = {}
        self._predicted: dict[bytes, dict[str, float]] = {}  # key -> worker -> expiry (monotonic)
        self._num_predicted = 0
        self.tier: set[bytes] = set()  # block keys the offload tier holds (every worker's)

    def apply_tier(self, stored: bytes = b"", removed: bytes = b"", whole: bool = False) -> None:
        if whole:
            self.tier = set()
        self.tier.update(split_keys(stored))
        self.tier.difference_update(split_keys(removed))

    def tier_run(self, keys: Sequence[bytes], start: int) -> int:
        """How many keys from start on the tier holds, in a row."""
        count = 0
        for key in keys[start:]:
            if key not in self.tier:
                break
            count += 1
        return count

    def apply(self, worker_id: str, stored: bytes = b"", removed: bytes = b"", cleared: bool = False) -> None:
        """One reply's events: cleared, then stored, then removed (a net diff: no key is in both)."""
        if cleared:
            self.drop(worker_id)
        keys = self._keys_of.setdefault(worker_id, set())
        for key in split_keys(stored):
            keys.add(key)
            self._workers_of.setdefault(key, set()).add(worker_id)
            self._unpredict(key, worker_id)
        for key in split_keys(removed):
            keys.discard(key)
            self._unpredict(key, worker_id)
            holders = self._workers_of.get(key)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._workers_of[key]

    def drop(self, worker_id: str) -> None:
        for key in self._keys_of.pop(worker_id, ()):
            holders = self._workers_of[key]
            holders.discard(worker_id)
            if not holders:
                del self._workers_of[key]
        for key in [k for k, workers in self._predicted.items() if worker_id in workers]:
            self._unpredict(key, worker_id)

    def predict(self, worker_id: str, keys: Sequence[bytes], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in keys:
            self._predicted.setdefault(key, {})[worker_id] = now + PREDICTED_TTL_S
        self._num_predicted += len(keys)
        if self._num_predicted >= PRUNE_EVERY:
            self._num_predicted = 0
            for key in list(self._predicted):
                for w in [w for w, expiry in self._predicted[key].items() if expiry <= now]:
                    self._unpredict(key, w)

    def _unpredict(self, key: bytes, worker_id: str) -> None:
        workers = self._predicted.get(key)
        if workers is not None and workers.pop(worker_id, None) is not None and not workers:
            del self._predicted[key]

    def num_cached(self, worker_id: str) -> int:
        return len(self._keys_of.get(worker_id, ()))

    def overlaps(self, keys: Sequence[bytes], worker_ids: Sequence[str], now: float | None = None) -> dict[str, int]:
        """Per worker, its cached prefix in blocks (held or predicted leading keys)."""
        now = time.monotonic() if now is None else now
        overlap = dict.fromkeys(worker_ids, 0)
        alive = set(worker_ids)
        for depth, key in enumerate(keys, start=1):
            predicted = self._predicted.get(key, {})
            alive &= self._workers_of.get(key, set()) | {w for w, expiry in predicted.items() if expiry > now}
            if not alive:
                break
            for worker_id in alive:
                overlap[worker_id] = depth
        return overlap


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    load_blocks: int  # blocks its running requests hold + new blocks of those waiting there


class Router:
    def __init__(self, mode: str = "prefix", prefill_weight: float = 1.0, decode_weight: float = 1.0) -> None:
        """Settings as SchedulerConfig validated them (shared/scheduler_config.py)."""
        self.mode, self.prefill_weight, self.decode_weight = mode, prefill_weight, decode_weight
        self.index = PrefixIndex()
        self._turn = itertools.count()

    def costs(self, keys: Sequence[bytes], num_blocks: int, overlaps: dict[str, int],
              candidates: Sequence[Candidate]) -> dict[str, float]:
        """Each candidate's cost (the module's formula); keys without the last block's."""
        costs = {}
        for c in candidates:
            new = num_blocks - overlaps[c.worker_id]
            prefill = new - (1 - TIER_LOAD_WEIGHT) * self.index.tier_run(keys, overlaps[c.worker_id])
            costs[c.worker_id] = self.prefill_weight * prefill + self.decode_weight * (c.load_blocks + new)
        return costs

    def choose(self, keys: Sequence[bytes], num_blocks: int, candidates: Sequence[Candidate]) -> tuple[str, int]:
        """(the chosen worker's id, the request's blocks not cached there)."""
        if not candidates:
            raise ValueError("no worker to place on")
        keys = keys[:max(0, num_blocks - 1)]  # the kvstore always computes the last block's token
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        turn = next(self._turn) % len(ordered)
        rotation = {c.worker_id: (i - turn) % len(ordered) for i, c in enumerate(ordered)}
        if self.mode == "round-robin":
            chosen = ordered[turn].worker_id
            return chosen, num_blocks - self.index.overlaps(keys, [chosen])[chosen]
        overlaps = self.index.overlaps(keys, [c.worker_id for c in ordered])
        costs = self.costs(keys, num_blocks, overlaps, ordered)
        chosen = min(ordered, key=lambda c: (costs[c.worker_id], c.load_blocks, rotation[c.worker_id])).worker_id
        self.index.predict(chosen, keys)
        return chosen, num_blocks - overlaps[chosen]
