"""The prefix hash of a full block: SHA-256 over the parent block's hash and this block's
token ids, so equal hashes mean equal whole prefixes, not just equal blocks.

Anything else that changes the K/V (the model, a per-request cache salt) goes into the
root: the parent of a request's first block is root_hash(extra_keys) instead of the zero
hash, and the chain carries it into every later block. Two models (or two salts) never
share a block, and the per-block cost stays one SHA-256 over parent + tokens.

Stable across processes and machines (unlike Python's hash()): the kvstore may outlive a
scheduler, and several services must agree on the same hash for the same prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = b"\x00" * 32  # the parent of a request's first block when nothing else is keyed


def root_hash(extra_keys: Sequence[str] = ()) -> bytes:
    """The chain's root for these extra keys (e.g. the model name, a cache salt): each key
    is length-prefixed UTF-8, so ("ab", "c") and ("a", "bc") differ. No keys: ROOT_HASH."""
    keys = [key for key in extra_keys if key]
    if not keys:
        return ROOT_HASH
    payload = b"".join(struct.pack("<I", len(data)) + data for data in (key.encode() for key in keys))
    return hashlib.sha256(b"pagedserve-prefix-root\x00" + payload).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Token ids are packed little-endian uint32 (struct.error for a negative id)."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent_hash + payload).digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, parent: bytes = ROOT_HASH) -> list[bytes]:
    """Chained hashes of every full block of token_ids after `parent`; a partial last
    block has none."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
