"""Chained SHA-256 block hashes (equal hash = equal whole prefix, model and salt in the root),
stable across processes so services agree."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = b"\x00" * 32  # the parent of a request's first block when nothing else is keyed


def root_hash(extra_keys: Sequence[str] = ()) -> bytes:
    """The chain's root for extra keys (length-prefixed UTF-8 each); no keys: ROOT_HASH."""
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
    """Chained hashes of every full block of token_ids after `parent` (none for a partial one)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class BlockHashes:
    """One request's chained full-block hashes, each computed once as its tokens become known (as
    vLLM's request.block_hashes); they travel with it to the router and the kvstore."""

    root: bytes
    block_size: int
    hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """The tokens the hashes cover (whole blocks)."""
        return len(self.hashes) * self.block_size

    def extend(self, token_ids: Sequence[int]) -> None:
        """token_ids: the request's tokens from num_tokens on; each full block among them is hashed."""
        self.hashes.extend(hash_full_blocks(token_ids, self.block_size, self.hashes[-1] if self.hashes else self.root))
