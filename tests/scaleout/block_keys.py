"""A prompt's router keys, built as the scheduler builds them when it places a request
(Workers.place: BlockHashes from the model and salt's root, each hash cut to KEY_BYTES)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.shared.block_hash import BlockHashes, root_hash
from pagedserve.shared.messages import KEY_BYTES


def block_keys(token_ids: Sequence[int], block_size: int, model: str, cache_salt: str = "") -> list[bytes]:
    hashes = BlockHashes(root_hash((model, cache_salt)), block_size)
    hashes.extend(token_ids)
    return [h[:KEY_BYTES] for h in hashes.hashes]
