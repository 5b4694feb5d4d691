"""Draft verification's attention: a step of decodes beside requests whose query is their last token
plus 1-4 drafts over long cached contexts (ending mid-block and on a block edge), against the dense
reference, with the SDPA and the CPU-kernel decode paths, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend
from tests.gpu_worker.test_attention import check_against_reference, make_step

VERIFY_STEP = [(1, 300), (5, 305), (2, 33), (1, 16), (4, 64), (3, 129), (1, 7), (5, 517)]


@pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa-decodes", "cpu-kernel-decodes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verification_queries_beside_decodes_match_the_reference(dtype, use_kernel):
    step = make_step(VERIFY_STEP, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                     shared_blocks=4, seed=11)
    check_against_reference(TorchPagedBackend(use_kernel), *step)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["sdpa-decodes", "cpu-kernel-decodes"])
def test_a_lone_verification_query_matches_the_reference(use_kernel):
    step = make_step([(5, 250)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32,
                     seed=5)
    check_against_reference(TorchPagedBackend(use_kernel), *step)
