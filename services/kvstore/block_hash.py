"""The prefix hash of a full block: SHA-256 over the parent block's hash and this block's
token ids, so equal hashes mean equal whole prefixes, not just equal blocks.

Stable across processes and machines (unlike Python's hash()): the kvstore may outlive a
scheduler, and several services must agree on the same hash for the same prefix.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = b"\x00" * 32  # the parent of a request's first block


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Token ids are packed little-endian uint32 (struct.error for a negative id)."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent_hash + payload).digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of token_ids; a partial last block has none."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
