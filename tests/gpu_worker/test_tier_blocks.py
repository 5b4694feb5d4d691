"""Moving blocks between a pool and the tier's bytes (services/gpu_worker/tier_blocks.py):
exact round trips in every pool dtype, and a miss moves the request's computation back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.services.gpu_worker import tier_blocks
from pagedserve.services.gpu_worker.pack_buffers import PackBuffers
from pagedserve.shared.messages import NewRequestData, SamplingParams, StepPlan


def pool(dtype: torch.dtype, num_blocks: int = 4, layers: int = 3) -> list[torch.Tensor]:
    shape = (2, num_blocks, 4, 2, 8)  # [K/V, blocks, block_size, Hkv, D]
    if dtype == torch.int8:
        return [torch.randint(-127, 128, shape, dtype=torch.int8) for _ in range(layers)]
    return [torch.randn(shape).to(dtype) for _ in range(layers)]


def buffer(kv: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.full((rows, tier_blocks.block_bytes(kv)), 7, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_blocks_pack_and_unpack_exactly_into_other_blocks(dtype):
    kv = pool(dtype)
    blobs = tier_blocks.pack_blocks(kv, [1, 0], buffer(kv, 3))
    size = tier_blocks.block_bytes(kv)
    assert size == 3 * 2 * 4 * 2 * 8 * kv[0].element_size() and [len(b) for b in blobs] == [size, size]
    tier_blocks.unpack_block(kv, 3, bytes(blobs[0]))
    tier_blocks.unpack_block(kv, 2, blobs[1])
    for layer in kv:
        assert torch.equal(layer[:, 3], layer[:, 1]) and torch.equal(layer[:, 2], layer[:, 0])


def test_a_packed_block_is_each_layers_slice_in_layer_order():
    kv = pool(torch.float32, layers=2)
    (blob,) = tier_blocks.pack_blocks(kv, [2], buffer(kv, 1))
    expected = torch.cat([layer[:, 2].reshape(-1) for layer in kv])
    assert torch.equal(torch.frombuffer(bytearray(blob), dtype=torch.float32), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_the_host_pack_gives_the_device_packs_bytes(dtype):
    kv = pool(dtype, num_blocks=6)
    host, device = buffer(kv, 5), buffer(kv, 4)
    blobs = [bytes(b) for b in tier_blocks.pack_blocks(kv, [5, 0, 3, 0], host)]
    tier_blocks._pack_on_device(kv, [5, 0, 3, 0], device)
    assert blobs == [bytes(row.numpy()) for row in device] and host[4].eq(7).all()


def test_namespaces_differ_by_dtype_layout_and_block_size():
    names = {tier_blocks.pool_namespace("m", pool(d), 4) for d in (torch.float32, torch.bfloat16, torch.int8)}
    names |= {tier_blocks.pool_namespace("m", pool(torch.float32, layers=2), 4),
              tier_blocks.pool_namespace("m", pool(torch.float32), 8),
              tier_blocks.pool_namespace("other", pool(torch.float32), 4)}
    assert len(names) == 6


def new_request(loads) -> NewRequestData:
    # 13 tokens, blocks 0-1 a pool hit, 2 loaded from the tier: computes token 12 only
    return NewRequestData("r", list(range(13)), [3, 2, 1, 0], 12, 1, SamplingParams(), tier_loads=loads)


def test_loads_fill_the_blocks_and_a_miss_is_computed_from_its_block_on():
    kv = pool(torch.float32)
    source = pool(torch.float32)
    blobs = {b"h1": bytes(tier_blocks.pack_blocks(source, [0], buffer(source, 1))[0])}
    plan = StepPlan(1, new_requests=[new_request([(1, b"h1"), (2, b"h2")])])
    step = tier_blocks.TierStep()
    missed = tier_blocks.apply_loads(kv, 4, plan, blobs, step)
    assert torch.equal(kv[0][:, 2], source[0][:, 0])  # block index 1 is block id 2
    new = plan.new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (8, 5)  # from block index 2 on
    assert missed == [("r", 2, b"h2")] and (step.num_loaded, step.num_missed) == (1, 1)


def test_a_blob_of_the_wrong_size_is_a_miss():
    kv = pool(torch.float32)
    plan = StepPlan(1, new_requests=[new_request([(1, b"h1"), (2, b"h2")])])
    step = tier_blocks.TierStep()
    tier_blocks.apply_loads(kv, 4, plan, {b"h1": b"short", b"h2": b"x"}, step)
    assert (plan.new_requests[0].num_computed_tokens, step.num_missed) == (4, 2)


def test_stores_are_packed_into_a_reused_buffer_given_back_once_written():
    kv = pool(torch.float32)
    buffers = PackBuffers(tier_blocks.block_bytes(kv), max_free_bytes=10 * tier_blocks.block_bytes(kv))
    requests = {"r": SimpleNamespace(block_ids=[3, 1], num_computed_tokens=6)}
    step = tier_blocks.TierStep()
    # block index 1 holds tokens 4-7, only 4-5 computed: skipped; an unknown request: skipped
    tier_blocks.collect_stores(kv, 4, requests, [("r", 0, b"h0"), ("r", 1, b"h1"), ("x", 0, b"hx")], step, buffers)
    assert [(h, bytes(blob)) for h, blob in step.stores] == [
        (b"h0", bytes(tier_blocks.pack_blocks(kv, [3], buffer(kv, 1))[0]))]
    assert (buffers.num_taken, buffers.num_allocated) == (1, 1)
    buffers.give(step.buffer)
    again = tier_blocks.TierStep()
    tier_blocks.collect_stores(kv, 4, requests, [("r", 0, b"h0")], again, buffers)
    assert again.buffer is step.buffer and (buffers.num_taken, buffers.num_allocated) == (1, 1)
    buffers.give(again.buffer)
    buffers.check_integrity()


def test_a_free_pack_buffer_too_small_is_replaced_and_the_free_ones_stay_within_budget():
    buffers = PackBuffers(row_bytes=8, max_free_bytes=32)
    small = buffers.take(1)
    buffers.give(small)
    big = buffers.take(4)
    assert big.shape == (4, 8) and big is not small and buffers.free_bytes() == 0
    other = buffers.take(1)
    buffers.give(big)
    buffers.give(other)  # 32 bytes free already: dropped
    assert buffers.free_bytes() == 32 and buffers.num_taken == 0 and buffers.num_allocated == 3
    buffers.check_integrity()
    with pytest.raises(ValueError):
        PackBuffers(row_bytes=0, max_free_bytes=1)
