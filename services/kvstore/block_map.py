"""The dashboard's picture of a pool, one byte a block: min(ref_cnt, REF_MAX) | CACHED if it carries
a prefix hash (free, cached free, in use, shared), keyed by worker id."""

from __future__ import annotations

from collections.abc import Mapping

CACHED = 0x80
REF_MAX = 0x7F
BLOCK_MAP_INTERVAL_S = 1.0  # the map is rewritten at most once a second: a walk over every block


def block_states(blocks) -> bytes:
    """One byte per block, in block id order (blocks: KVBlock-like, ref_cnt and block_hash)."""
    return bytes(min(block.ref_cnt, REF_MAX) | (CACHED if block.block_hash is not None else 0) for block in blocks)


def block_map(managers: Mapping[object, object]) -> dict:
    """{"workers": {str(worker_id): {"num_blocks", "block_size", "states"}}} of BlockManagers."""
    workers = {}
    for worker_id, manager in managers.items():
        if manager is None:
            continue
        workers[str(worker_id)] = {"num_blocks": manager.num_blocks, "block_size": manager.block_size,
                                   "states": block_states(manager.pool.blocks)}
    return {"workers": workers}


def summarize(states: bytes) -> dict[str, int]:
    """Counts of each kind in a states string (free, cached, in_use, shared)."""
    counts = {"free": 0, "cached": 0, "in_use": 0, "shared": 0}
    for byte in states:
        ref = byte & REF_MAX
        if ref == 0:
            counts["cached" if byte & CACHED else "free"] += 1
        else:
            counts["shared" if ref > 1 else "in_use"] += 1
    return counts
