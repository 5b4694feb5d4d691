"""y = x @ W^T: weights packed once for oneDNN (bf16: F.linear reorders on every call; float32:
oneDNN's packed sgemm beats MKL's on AVX2, as vLLM's CPU backend finds); steps of few rows go to
cpu_gemv(_f32).cpp on GGUF Q4_1/Q8_0 blocks or bf16 pairs, float32 ones up to F32_MANY_ROWS too.
A row's result does not depend on how many rows share the call up to the few-row kernels' most rows
(8; float32 Q8_0 and AVX2 Q4_1: F32_FEW_ROWS), so a verification step's rows round as lone decode
steps do; with AMX, bf16 rows AMX_MIN_ROWS to 256 take its tiles (another sum order; past 8, bf16(Q4_1)),
else rows 9 to 64 cpu_gemv_wide.h's loops. PAGEDSERVE_PACK_WEIGHTS / SMALL_M_GEMV / AMX_GEMV / WIDE_GEMV=0 turn these off.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model import gguf_blocks
from pagedserve.services.gpu_worker.model.bf16_gemm import float32_from_rows, onednn_packs_bf16, via_float32

PACK_BATCH_HINT = 64
F32_FEW_ROWS = 4  # float32 with GGUF blocks: rows up to this read blocks per row (linear_q4/q8),
F32_MANY_ROWS = 512  # then up to this a tile's blocks are dequantized once for all rows (linear_many)
F32_FEW_ROWS_AVX512 = 8  # F32_FEW_ROWS with AVX-512 BF16 (AMX Xeon, Zen 4): blocks per row stay ahead to 8
AMX_MIN_ROWS = 2  # bf16 rows from this (and past the Q8_0 rows) take AMX tiles: one row stays on AVX-512

_rows_alone = False


def rows_alone(on: bool) -> None:
    """From now on (on) few-row products sum each row as a one-row product does: no AMX tiles."""
    global _rows_alone
    _rows_alone = on


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") not in ("0", "false", "no")


def packing_enabled(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not _env_on("PAGEDSERVE_PACK_WEIGHTS"):
        return False
    if weight.dtype == torch.float32:
        return _mkldnn_float32()
    return weight.dtype == torch.bfloat16 and onednn_packs_bf16()


@functools.cache
def _mkldnn_float32() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def bf16_packed(packed, weight: torch.Tensor) -> bool:
    return packed is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


def small_m_kernel(weight: torch.Tensor):
    bf16 = weight.dtype == torch.bfloat16 and packing_enabled(weight)
    float32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not ((bf16 or float32) and _env_on("PAGEDSERVE_SMALL_M_GEMV")
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0):
        return None
    module = cpu_extensions.load("gemv" if bf16 else "gemv_f32")
    return module if module is not None and module.supported() else None


@functools.cache
def f32_few_rows() -> int:
    """F32_FEW_ROWS_AVX512 on a CPU with AVX-512 BF16 (verification steps of up to 8 rows), else F32_FEW_ROWS."""
    module = cpu_extensions.load("gemv")
    return F32_FEW_ROWS_AVX512 if module is not None and module.supported() else F32_FEW_ROWS


def amx_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Q4_1 nibbles [N/16, K/2, 16] (gguf_blocks.pack_q4_1) -> row pairs [N/16, K/4, 32] for
    linear_q4_amx: byte j of pair s holds bf16 j of B row 2s (its pairs layout: output j // 2, k
    4s + j % 2) in its low nibble and of row 2s + 1 (k + 2) in its high one."""
    num_blocks, k2, _ = nibbles.shape
    rows = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(num_blocks, k2 // 2, 2, 32)
    return (rows[:, :, 0] | (rows[:, :, 1] << 4)).contiguous()


def q8_pairs(q: torch.Tensor) -> torch.Tensor:
    """Q8_0 q [N/16, K, 16] (gguf_blocks.pack_q8_0) -> pairs layout [N/16, K/2, 16, 2] for cpu_gemv's
    linear_q8: 32 bytes hold 16 outputs' weights at two consecutive k."""
    num_blocks, k, _ = q.shape
    return q.view(num_blocks, k // 2, 2, 16).transpose(2, 3).contiguous()


def _blocks_are_weight(blocks: tuple[torch.Tensor, ...], weight: torch.Tensor) -> bool:
    """The blocks dequantize to the parameter (in its dtype) and suit the kernels' tiling."""
    q = blocks[0]
    if q.shape != weight.shape or weight.shape[1] % 32:
        return False
    return torch.equal(gguf_blocks.dequantize(*blocks).to(weight.dtype), weight.detach())


class PackedLinear:
    """A projection by one [out, in] weight; packed where packing_enabled(), else F.linear."""

    def __init__(self, weight: torch.Tensor, pack: bool = True, blocks: tuple[torch.Tensor, ...] | None = None) -> None:
        """blocks: the weight's GGUF Q4_1 (q, d, m) or Q8_0 (q, d) blocks, read by few-row products."""
        self.weight = weight  # the parameter itself: the unpacked path follows its updates
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
                       if pack and packing_enabled(weight) else None)
        self.gemv = small_m_kernel(weight) if pack else None
        self.float32_from_rows = float32_from_rows() if bf16_packed(self.packed, weight) else 0
        self.gemv_packed = self.gemv_q4 = self.gemv_q8 = None
        bf16 = self.packed is not None and weight.dtype == torch.bfloat16
        if self.gemv is None or blocks is None or not _blocks_are_weight(blocks, weight):
            blocks = None
        self.max_gemv_rows = self.gemv.max_rows() if self.gemv is not None else 0
        self.amx = (bf16 and self.gemv is not None and weight.shape[1] % 32 == 0 and _env_on("PAGEDSERVE_AMX_GEMV")
                    and self.gemv.max_amx_rows() > 0)
        self.wide = (bf16 and self.gemv is not None and not self.amx and weight.shape[1] % 32 == 0
                     and _env_on("PAGEDSERVE_WIDE_GEMV") and self.gemv.max_wide_rows() > 0)
        self.max_alone_rows = self.max_gemv_rows
        if self.amx or self.wide:
            self.max_gemv_rows = self.gemv.max_amx_rows() if self.amx else self.gemv.max_wide_rows()
        self.max_q8_rows = self.max_many_rows = 0
        if blocks is not None and weight.dtype == torch.float32:
            self.max_gemv_rows = min(f32_few_rows(), self.max_gemv_rows)
            self.max_many_rows = min(F32_MANY_ROWS, self.gemv.max_many_rows())
        if blocks is not None and len(blocks) == 3:
            self.gemv_q4 = gguf_blocks.pack_q4_1(*blocks)
            if bf16:  # cpu_gemv.cpp's Q4_1 kernels (AVX-512 and AMX) read row pairs
                self.gemv_q4 = amx_nibbles(self.gemv_q4[0]), self.gemv_q4[1]
            return
        if blocks is not None:
            self.gemv_q8 = gguf_blocks.pack_q8_0(*blocks)
            if bf16:
                self.gemv_q8 = q8_pairs(self.gemv_q8[0]), self.gemv_q8[1]
            self.max_q8_rows = min(self.gemv.max_rows(), self.max_gemv_rows)
        if self.gemv is not None and bf16 and (self.gemv_q8 is None or self.max_gemv_rows > self.max_q8_rows):
            self.gemv_packed = self.gemv.pack(weight.detach())
        elif self.gemv_q8 is None:
            self.gemv, self.max_gemv_rows = None, 0  # float32 without blocks: F.linear throughout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        rows = x.shape[0]
        batched = self.amx or self.wide  # rows past the few-row kernels' may take these (not verifying)
        tiles = batched and not _rows_alone
        if rows <= (self.max_alone_rows if batched and not tiles else self.max_gemv_rows):
            out = x.new_empty(rows, self.weight.shape[0])
            amx = tiles and self.amx and rows >= AMX_MIN_ROWS
            wide = tiles and self.wide and rows > self.max_alone_rows
            g = self.gemv
            if self.gemv_q4 is not None:
                (g.linear_q4_amx if amx else g.linear_q4_wide if wide else g.linear_q4)(out, x.contiguous(),
                                                                                       *self.gemv_q4)
            elif rows <= self.max_q8_rows:
                g.linear_q8(out, x.contiguous(), *self.gemv_q8)
            else:
                (g.linear_amx if amx else g.linear_wide if wide else g.linear)(out, x.contiguous(), self.gemv_packed)
            return out
        if x.shape[0] <= self.max_many_rows:
            out = x.new_empty(x.shape[0], self.weight.shape[0])
            self.gemv.linear_many(out, x.contiguous(), *(self.gemv_q8 if self.gemv_q4 is None else self.gemv_q4))
            return out
        if self.packed is None:
            return F.linear(x, self.weight)
        if self.float32_from_rows and x.shape[0] >= self.float32_from_rows:
            return via_float32(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
