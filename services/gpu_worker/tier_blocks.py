"""Moving whole KV blocks between the worker's pool and the offload tier's bytes (torch, no Redis).

A block's bytes are every layer's slice [:, block_id] of the pool, layer after layer, as the pool
stores them (bf16, float32 or int8 rows with their scales alike). Loads run before the step's
forward pass: a block the tier could not give (missing, wrong size) and every one after it in that
request are computed in this step instead, and stored after it, so the tier heals itself."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.services.gpu_worker.pack_buffers import PackBuffers
from pagedserve.services.gpu_worker.tier_fills import TierFills
from pagedserve.shared.kv_tier import tier_namespace
from pagedserve.shared.messages import StepPlan, StepResult

log = logging.getLogger("pagedserve.worker")


def block_bytes(kv_caches: list[torch.Tensor]) -> int:
    return sum(layer[:, 0].numel() * layer.element_size() for layer in kv_caches)


def pool_namespace(model: str, kv_caches: list[torch.Tensor], block_size: int) -> str:
    first = kv_caches[0]
    return tier_namespace(model, f"{first.dtype}/{len(kv_caches)}", block_size, tuple(first[:, 0].shape))


def pack_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], out: torch.Tensor) -> list[memoryview]:
    """Each block's bytes as a row of `out` (uint8 [>= len(block_ids), block_bytes], host)."""
    array = out[:len(block_ids)].numpy()
    if kv_caches[0].device.type == "cpu":
        _pack_on_host(kv_caches, np.asarray(block_ids), array)
    else:
        _pack_on_device(kv_caches, block_ids, out[:len(block_ids)])
    return [memoryview(array[row]) for row in range(len(block_ids))]


def _pack_on_host(kv_caches: list[torch.Tensor], ids: np.ndarray, array: np.ndarray) -> None:
    """numpy copies on this thread alone: torch's OpenMP team spins while the writer and Redis run."""
    offset = 0
    for layer in kv_caches:
        source = layer.view(torch.uint8).numpy().reshape(layer.shape[0], layer.shape[1], -1)
        size = source.shape[0] * source.shape[2]
        target = array[:, offset:offset + size].reshape(len(ids), source.shape[0], source.shape[2])
        for part in range(source.shape[0]):
            target[:, part] = source[part, ids]
        offset += size


def _pack_on_device(kv_caches: list[torch.Tensor], block_ids: list[int], rows: torch.Tensor) -> None:
    ids = torch.tensor(block_ids, device=kv_caches[0].device)
    offset = 0
    for layer in kv_caches:
        shape, size = layer[:, 0].shape, layer[:, 0].numel() * layer.element_size()
        target = rows[:, offset:offset + size].view(layer.dtype).view(len(block_ids), *shape)
        target.copy_(layer.index_select(1, ids).transpose(0, 1))
        offset += size


def unpack_block(kv_caches: list[torch.Tensor], block_id: int, blob: bytes) -> None:
    flat = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    offset = 0
    for layer in kv_caches:
        target = layer[:, block_id]
        size = target.numel() * layer.element_size()
        target.copy_(flat[offset:offset + size].view(layer.dtype).view(target.shape))
        offset += size


@dataclass
class TierStep:
    """What one step moved: the loads it made, the misses it computed, the blocks to store (eager:
    the step's own result waits for them)."""

    num_loaded: int = 0
    num_missed: int = 0
    stores: list[tuple[bytes, memoryview]] = field(default_factory=list)  # (hash, row of buffer)
    buffer: torch.Tensor | None = None
    eager: list[tuple[bytes, memoryview]] = field(default_factory=list)
    eager_buffer: torch.Tensor | None = None
    filled: list[tuple[str, int, bytes]] = field(default_factory=list)


@dataclass
class StoreTally:
    """Writes finished since the last StepResult took them."""

    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def add(self, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.num_blocks += num_blocks
        self.num_bytes += num_bytes
        self.seconds += seconds

    def take_into(self, result: StepResult) -> None:
        result.num_tier_stored_blocks, result.tier_stored_bytes = self.num_blocks, self.num_bytes
        result.tier_store_seconds = self.seconds
        self.num_blocks, self.num_bytes, self.seconds = 0, 0, 0.0


def hashes_to_load(plan: StepPlan) -> list[bytes]:
    return [block_hash for new in plan.new_requests for _index, block_hash in new.tier_loads]


def apply_loads(kv_caches: list[torch.Tensor], block_size: int, plan: StepPlan, blobs: dict[bytes, bytes],
                step: TierStep) -> list[tuple[str, int, bytes]]:
    """Copy the plan's tier blocks into the pool (before the forward pass); a request's first miss
    moves its computation back to that block. Returns the missed blocks, to store once computed."""
    expected = block_bytes(kv_caches)
    missed: list[tuple[str, int, bytes]] = []
    for new in plan.new_requests:
        for position, (index, block_hash) in enumerate(new.tier_loads):
            blob = blobs.get(block_hash)
            if blob is None or len(blob) != expected or index >= len(new.block_ids):
                first_token = index * block_size
                if first_token < new.num_computed_tokens:
                    new.num_scheduled_tokens += new.num_computed_tokens - first_token
                    new.num_computed_tokens = first_token
                rest = new.tier_loads[position:]
                missed.extend((new.request_id, i, h) for i, h in rest)
                step.num_missed += len(rest)
                break
            unpack_block(kv_caches, new.block_ids[index], blob)
            step.num_loaded += 1
    return missed


def computed_block(requests: dict, request_id: str, index: int, block_size: int) -> int | None:
    state = requests.get(request_id)
    if state is None or index >= len(state.block_ids) or state.num_computed_tokens < (index + 1) * block_size:
        return None
    return state.block_ids[index]


def pack(kv_caches: list[torch.Tensor], blocks: list[tuple[bytes, int]],
         buffers: PackBuffers) -> tuple[list[tuple[bytes, memoryview]], torch.Tensor | None]:
    if not blocks:
        return [], None
    buffer = buffers.take(len(blocks))
    try:
        rows = pack_blocks(kv_caches, [block_id for _h, block_id in blocks], buffer)
    except BaseException:
        buffers.give(buffer)
        raise
    return [(block_hash, row) for (block_hash, _b), row in zip(blocks, rows, strict=True)], buffer


def collect_stores(kv_caches: list[torch.Tensor], block_size: int, requests: dict, stores: list,
                   step: TierStep, buffers: PackBuffers, eager_ids: frozenset[str] = frozenset(),
                   fills: Sequence[tuple[str, int, bytes, int]] = ()) -> None:
    """Pack each block to store whose request now holds it computed (anything else is skipped:
    a block never reaches the tier unless this worker computed or loaded all its tokens); eager:
    eager_ids' requests' and the fills (request id, index, hash, pool block id)."""
    lazy, eager = [], []
    for request_id, index, block_hash in stores:
        block_id = computed_block(requests, request_id, index, block_size)
        if block_id is not None:
            (eager if request_id in eager_ids else lazy).append((block_hash, block_id))
    step.stores, step.buffer = pack(kv_caches, lazy, buffers)
    eager += [(block_hash, block_id) for _r, _i, block_hash, block_id in fills]
    step.eager, step.eager_buffer = pack(kv_caches, eager, buffers)
    step.filled = [(request_id, index, block_hash) for request_id, index, block_hash, _b in fills]


def execute(worker, plan: StepPlan, blobs: dict[bytes, bytes], buffers: PackBuffers,
            fills: TierFills) -> tuple[StepResult, TierStep]:
    """worker.execute(plan) with the tier's loads before it and its stores packed after it."""
    step = TierStep()
    kv_caches, block_size = worker.pool.kv_caches, worker.block_size
    missed = apply_loads(kv_caches, block_size, plan, blobs, step)
    result = worker.execute(plan)
    result.num_tier_loaded_blocks, result.num_tier_missed_blocks = step.num_loaded, step.num_missed
    full = fills.take_full(worker.requests, plan)
    if plan.tier_stores or missed or full:
        sampled = frozenset(token.request_id for token in result.sampled)
        collect_stores(kv_caches, block_size, worker.requests, [*plan.tier_stores, *missed], step, buffers,
                       sampled, full)
    return result, step
