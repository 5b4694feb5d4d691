"""Draft verification's attention: a step of decodes beside requests whose query is their last token
plus 1-4 drafts over long cached contexts (ending mid-block and on a block edge), against the dense
reference, with the SDPA and the CPU-kernel decode paths, float32 and bfloat16; the Triton kernels
under the interpreter (a child python: TRITON_INTERPRET is read when triton is first imported) and,
where CUDA is present, the Triton and torch backends on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.services.gpu_worker.attention import get_backend
from pagedserve.services.gpu_worker.attention.torch_paged import TorchPagedBackend
from tests.gpu_worker.test_attention import check_against_reference, make_step

REPO_ROOT = Path(__file__).resolve().parents[2]

VERIFY_STEP = [(1, 300), (5, 305), (2, 33), (1, 16), (4, 64), (3, 129), (1, 7), (5, 517)]
SHORT_VERIFY_STEP = [(1, 37), (5, 69), (2, 33), (4, 64), (1, 7)]  # the interpreter runs each program in Python


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_lone_queries_rows_give_the_lone_decodes_bits(dtype, num_threads):
    """One kernel call for a lone request's 7 rows, each row's context split over the threads as its own
    lone decode step's would be: the same bits as 7 one-row decodes (greedy text kept by speculation)."""
    kernel = TorchPagedBackend(use_kernel=None)._kernel
    if kernel is None:
        pytest.skip("the CPU decode kernel did not build")
    q_len, seq_len = 7, 420
    meta, cache, q, k, v = make_step([(q_len, seq_len)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                                     dtype=dtype, seed=3)
    tables = meta.block_tables.to(torch.int32).contiguous()
    lens = torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        together, alone = torch.empty_like(q), torch.empty_like(q)
        kernel.paged_decode_attention(together, q, cache, tables.expand(q_len, -1).contiguous(), lens,
                                      torch.arange(q_len), 0.125, True)
        for r in range(q_len):
            kernel.paged_decode_attention(alone, q, cache, tables, lens[r:r + 1], torch.tensor([r]), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


def check_verification_steps(backend_name: str, device: str, dtypes=(torch.float32, torch.bfloat16),
                             requests=VERIFY_STEP) -> None:
    for dtype in dtypes:
        step = make_step(requests, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype,
                         shared_blocks=2, seed=11, device=device)
        check_against_reference(get_backend(backend_name), *step)


def test_triton_verification_queries_under_the_interpreter():
    code = ("from tests.gpu_worker.test_spec_attention import check_verification_steps as c, SHORT_VERIFY_STEP as s; "
            "c('triton', 'cpu', requests=s)")
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path})
    assert child.returncode == 0, child.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and compiled (not interpreted) kernels")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_verification_queries_on_cuda(backend, dtype):
    check_verification_steps(backend, "cuda", (dtype,))
