"""An int8 KV pool served through real processes (kvstore, worker, scheduler over Redis): a request
alone gets the in-process engine's tokens, a batch sharing a prefix block that needs more blocks
than the pool holds completes, and every block ends free with the kvstore's counts exact."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.engine import Engine
from pagedserve.shared.config import EngineConfig
from pagedserve.shared.messages import SamplingParams
from tests.services.conftest import TestApi, start_backend

pytestmark = pytest.mark.slow

# 96 token slots: three 32-token prompts (one block shared, one own) take 4 blocks, and each one's
# decode needs a third: 7 > 6, so the batch cannot run to the end all at once
NUM_BLOCKS = 6
WORKER = ["--dtype", "bfloat16", "--num-blocks", str(NUM_BLOCKS), "--worker-id", "0", "--kv-cache-dtype", "int8"]


@pytest.fixture(scope="module")
def int8_stack(tmp_path_factory):
    stack = start_backend(tmp_path_factory.mktemp("int8"), args={"worker": WORKER})
    yield stack
    stack.close()


def test_int8_pool_serves_like_the_engine_and_frees_every_block(int8_stack):
    prefix = list(range(100, 116))  # one full block shared by the batch's prompts
    prompts = [prefix + [7 + i + j for j in range(16)] for i in range(3)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    api = TestApi(int8_stack)
    kv_before = int8_stack.stats("kvstore") or {}
    try:
        alone = api.wait_finished([api.submit(prompts[0], greedy)], timeout=300.0)[0]
        batch = api.wait_finished([api.submit(p, greedy) for p in prompts], timeout=300.0)
        assert [len(o.token_ids) for o in batch] == [8, 8, 8]
        assert all(o.finish_reason == "length" for o in batch)
    finally:
        api.close()
    engine = Engine(EngineConfig(dtype="bfloat16", num_blocks=NUM_BLOCKS, kv_cache_dtype="int8"))
    assert engine.worker.pool.kv_caches[0].dtype == torch.int8
    assert alone.token_ids == engine.generate([prompts[0]], greedy)[0].token_ids
    stats = int8_stack.wait_kvstore_clean(since=kv_before)  # every block back, integrity checked
    assert stats["num_blocks"] == NUM_BLOCKS and stats["num_free_blocks"] == NUM_BLOCKS
