"""The worker's side of tier fills (services/gpu_worker/tier_fills.py, tier_blocks.collect_stores,
tier_writer): a fill is hashed from its parent and the worker's tokens once its block is full and
computed, packed as an eager store, and the step's result waits for it and names it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from pagedserve.services.gpu_worker import tier_blocks
from pagedserve.services.gpu_worker.pack_buffers import PackBuffers
from pagedserve.services.gpu_worker.tier_fills import TierFills
from pagedserve.services.gpu_worker.tier_writer import TierWriter
from pagedserve.shared.block_hash import hash_block
from pagedserve.shared.messages import StepPlan
from pagedserve.shared.streams import Keys
from tests.gpu_worker.test_tier_writer import GatedClient, blocks

PARENT = b"\x05" * 32


def state(tokens: list[int], num_computed: int, block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=num_computed, block_ids=block_ids)


def test_a_fill_is_hashed_once_its_block_is_full_and_computed():
    fills = TierFills(block_size=4)
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    requests = {"a": state(tokens[:7], 7, [3, 9])}  # a rejected draft: block 1 holds 3 of its 4 tokens
    assert fills.take_full(requests, StepPlan(5, tier_fills=[("a", 1, PARENT), ("gone", 0, PARENT)])) == []
    assert len(fills) == 1  # waits for the step that fills it; an unknown request's is dropped
    requests["a"] = state(tokens + [18], 8, [3, 9])
    assert fills.take_full(requests, StepPlan(6)) == [("a", 1, hash_block(PARENT, tokens[4:8]), 9)]
    assert len(fills) == 0


def test_a_reset_drops_the_fills_of_the_requests_it_dropped():
    fills = TierFills(block_size=4)
    fills.take_full({}, StepPlan(1, tier_fills=[("a", 0, PARENT)]))
    fills.take_full({"a": state([1, 2], 2, [0])}, StepPlan(2, tier_fills=[("a", 0, PARENT)]))
    assert len(fills) == 1
    full = fills.take_full({"a": state([1, 2, 3, 4, 5], 4, [0])}, StepPlan(3, reset=True))
    assert full == [] and len(fills) == 0
    with pytest.raises(ValueError):
        TierFills(0)


def test_fills_and_stores_of_requests_that_sampled_are_eager_the_rest_lazy():
    kv = [torch.randn(2, 6, 4, 2, 8) for _ in range(2)]
    buffers = PackBuffers(tier_blocks.block_bytes(kv), max_free_bytes=0)
    requests = {"p": state(list(range(8)), 8, [0, 1]), "s": state(list(range(9)), 9, [2, 3, 4])}
    step = tier_blocks.TierStep()
    tier_blocks.collect_stores(kv, 4, requests, [("p", 0, b"p0"), ("s", 0, b"s0")], step, buffers,
                               frozenset({"s"}), [("s", 1, b"s1", 3)])
    rows = {h: bytes(row) for h, row in [*step.stores, *step.eager]}
    assert [h for h, _ in step.stores] == [b"p0"] and [h for h, _ in step.eager] == [b"s0", b"s1"]
    assert rows[b"s1"] == bytes(tier_blocks.pack_blocks(kv, [3], torch.empty(1, len(rows[b"s1"]),
                                                                              dtype=torch.uint8))[0])
    assert step.filled == [("s", 1, b"s1")] and buffers.num_taken == 2


class LaterGated(GatedClient):
    """Its first pipeline writes at once, the later ones once `gate` is set."""

    def pipeline(self, transaction: bool = True):
        pipe = super().pipeline(transaction)
        if not self.written and not getattr(self, "opened", False):
            self.opened = True
            gated = pipe.execute

            def at_once():
                self.gate.set()
                gated()
                self.gate.clear()

            pipe.execute = at_once
        return pipe


def test_a_result_waits_for_its_own_steps_eager_writes_and_names_the_fills_apart():
    client = LaterGated()
    writer = TierWriter(client, Keys("t"), "ns")

    async def scenario():
        writer.submit(7, blocks(b"e", b"f"), lambda: None, eager=True, filled=[("a", 1, b"f")])
        writer.submit(7, blocks(b"l"), lambda: None)
        await writer.wait_through(6, 5.0, eager_step=7)  # async: step 7's result, lag 1
        assert writer.take_written() == [b"e"] and writer.take_filled() == [("a", 1, b"f")]
        assert writer.num_pending() == 1  # the lazy write of step 7 waits for step 8's result
        client.gate.set()
        await writer.wait_through(7, 5.0, eager_step=8)
        assert writer.take_written() == [b"l"] and writer.take_filled() == [] and writer.num_pending() == 0

    asyncio.run(scenario())
    writer.close()
