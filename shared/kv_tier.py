"""The offload tier's keys, shared by the kvstore (index, eviction) and the workers (load, store).

A block's contents live in Redis under `<prefix>:kvtier:<namespace>:<hash hex>`; the namespace
digests everything besides the tokens that makes two blocks' bytes differ (model, KV dtype, block
size, the pool's per-block layout), so nothing keyed for one format is ever read as another.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from pagedserve.shared.redis_io import REDIS_ERRORS
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.kv_tier")

TIER_PART = "kvtier"


def tier_namespace(model: str, kv_dtype: str, block_size: int, block_shape: tuple[int, ...]) -> str:
    """16 hex digits naming one block format; block_shape: one layer's slice of one block."""
    text = f"{model}\x00{kv_dtype}\x00{block_size}\x00{'x'.join(map(str, block_shape))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tier_key(keys: Keys, namespace: str, block_hash: bytes) -> str:
    return f"{keys.prefix}:{TIER_PART}:{namespace}:{block_hash.hex()}"


def tier_pattern(keys: Keys) -> str:
    return f"{keys.prefix}:{TIER_PART}:*"


def tier_lru_key(keys: Keys) -> str:
    """A sorted set of `<namespace>:<hash hex>`, scored by last use: the tier's LRU order in Redis."""
    return f"{keys.prefix}:{TIER_PART}-lru"


def lru_member(namespace: str, block_hash: bytes) -> str:
    return f"{namespace}:{block_hash.hex()}"


def parse_tier_key(keys: Keys, key: str) -> tuple[str, bytes] | None:
    """(namespace, block hash) of a tier key, or None for any other key."""
    head = f"{keys.prefix}:{TIER_PART}:"
    if not key.startswith(head):
        return None
    namespace, _, hex_hash = key[len(head):].partition(":")
    try:
        return namespace, bytes.fromhex(hex_hash)
    except ValueError:
        return None


async def load_blocks(r, keys: Keys, namespace: str, hashes: list[bytes], timeout_s: float) -> dict[bytes, bytes]:
    """The contents the tier holds for these hashes; {} if Redis does not answer in time (the
    worker computes what it cannot load, so a slow or lost tier only costs the compute)."""
    if not hashes:
        return {}
    unique = list(dict.fromkeys(hashes))
    try:
        values = await asyncio.wait_for(r.mget([tier_key(keys, namespace, h) for h in unique]), timeout_s)
    except (TimeoutError, *REDIS_ERRORS) as e:
        log.warning("offload tier unreadable (%s: %s): computing %d blocks instead", type(e).__name__, e,
                    len(unique))
        return {}
    return {h: v for h, v in zip(unique, values, strict=True) if v is not None}


def store_blocks(client, keys: Keys, namespace: str, blocks: list[tuple[bytes, memoryview]]) -> bool:
    """Write block contents (hash, bytes) on a blocking client (the worker's writer thread: large
    values go to the socket as they are); False, logged, if Redis refused (readers will compute)."""
    pipe = client.pipeline(transaction=False)
    for block_hash, contents in blocks:
        pipe.set(tier_key(keys, namespace, block_hash), contents)
    try:
        pipe.execute()
    except REDIS_ERRORS as e:
        log.warning("offload tier unwritable (%s: %s): %d blocks not stored", type(e).__name__, e, len(blocks))
        return False
    return True
