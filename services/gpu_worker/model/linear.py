"""y = x @ W^T, with W packed once for oneDNN where that pays: bfloat16 on the CPU.

torch's plain bf16 F.linear on the CPU reorders the [out, in] weight into oneDNN's blocked
(AMX/AVX-512-BF16) layout on every call; for a decode step's few rows that reorder costs
as much as the product itself. Packing once at load time (mkldnn._reorder_linear_weight)
and calling mkldnn._linear_pointwise measured 1.5-3x faster per projection of SmolLM2 at
64 rows (576x576: 0.149 -> 0.041 ms; the 49152-row LM head 4.8 -> 3.1 ms), with identical
results. The batch-size hint only picks oneDNN's blocking: 64 was best or within 5% of
the best from 1 to 2048 rows (1 and 1024 were up to 2x worse at 64 rows).

A step of at most a few rows (a lone request decoding) goes to cpu_gemv.cpp instead,
where the CPU has AVX-512 BF16: oneDNN reads the weight at a third of the memory bandwidth
there on a CPU without AMX (Zen 4, SmolLM2's LM head at one row: 2.5 -> 1.6 ms; a layer's
projections 3-5x faster). That keeps a second copy of the weight in cpu_gemv's layout
(SmolLM2: +269 MB); PAGEDSERVE_SMALL_M_GEMV=0 turns it off. A projection loaded from GGUF
Q4_1 blocks keeps those instead (services.gpu_worker.model.gguf_blocks: 0.625 bytes a weight), so
a few-row step reads SmolLM2's layers from 66 MB instead of 212 MB, and multiplies by the
GGUF's exact weights (the float32 model's) where oneDNN's many-row path uses their bf16
roundings: a request's bf16 logits depend a little on how many rows its step has. The
LM head, from GGUF Q8_0 blocks, reads those at one or two rows (BF16_Q8_MAX_ROWS; 30 MB a
token instead of 57) and its bf16 pairs copy at three to eight.

float32 keeps F.linear (MKL sgemm, no reorder) for many rows. Its few-row steps read the
GGUF blocks where the CPU has AVX2, FMA and F16C (cpu_gemv_f32.cpp; float32 is the default
dtype where the CPU lacks AVX-512 BF16): SmolLM2's layers from Q4_1 (66 MB a token instead
of 424) and its LM head from Q8_0 (30 MB instead of 113). Those are the float32 weights'
exact values, summed in another order than MKL's: logits differ in the last bits, and
greedy output still matches HF transformers (tests/gpu_worker/test_model.py).
PAGEDSERVE_PACK_WEIGHTS=0 turns bf16 packing off (and the bf16 small-row path with it).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from services.gpu_worker.kernels import cpu_extensions
from services.gpu_worker.model import gguf_blocks

PACK_BATCH_HINT = 64
# bf16 rows up to this take a weight's Q8_0 blocks, more its bf16 pairs copy. SmolLM2's LM
# head on a Zen 4 (2 threads): 1 row 1.0-1.2 ms against 1.8-2.1, 2 rows 1.6-2.2 against
# 2.2-2.6, 3 rows 2.8 against 2.0 (the int8 -> float widening costs compute per row).
BF16_Q8_MAX_ROWS = 2


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") not in ("0", "false", "no")


def packing_enabled(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _mkldnn_bf16()
            and _env_on("PAGEDSERVE_PACK_WEIGHTS"))


@functools.cache
def _mkldnn_bf16() -> bool:
    """oneDNN packs bf16 weights only on a CPU with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT;
    elsewhere (AVX2 alone) _reorder_linear_weight raises, and bf16 keeps F.linear."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


def small_m_kernel(weight: torch.Tensor):
    """The module that serves this weight's few-row products, else None: cpu_gemv for bf16
    weights (packed for oneDNN) on a CPU with AVX-512 BF16; cpu_gemv_f32 for float32 ones
    (GGUF blocks only) on one with AVX2, FMA and F16C."""
    bf16 = packing_enabled(weight)
    float32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not ((bf16 or float32) and _env_on("PAGEDSERVE_SMALL_M_GEMV")
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0):
        return None
    module = cpu_extensions.load("gemv" if bf16 else "gemv_f32")
    return module if module is not None and module.supported() else None


def _blocks_are_weight(blocks: tuple[torch.Tensor, ...], weight: torch.Tensor) -> bool:
    """The blocks dequantize to the parameter (in its dtype) and suit the kernels' tiling."""
    q = blocks[0]
    if q.shape != weight.shape or weight.shape[1] % 32:
        return False
    return torch.equal(gguf_blocks.dequantize(*blocks).to(weight.dtype), weight.detach())


class PackedLinear:
    """A projection by one [out, in] weight; packed where packing_enabled(), else F.linear."""

    def __init__(self, weight: torch.Tensor, pack: bool = True, blocks: tuple[torch.Tensor, ...] | None = None) -> None:
        """blocks: the weight's GGUF blocks (services.gpu_worker.model.gguf_blocks: Q4_1 (q, d, m)
        or Q8_0 (q, d)), if it came from them: few-row products then read those instead of
        a copy of the weight. bf16 keeps its pairs copy too beside Q8_0 blocks, for the rows
        past BF16_Q8_MAX_ROWS."""
        self.weight = weight  # the parameter itself: the unpacked path follows its updates
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
                       if pack and packing_enabled(weight) else None)
        self.gemv = small_m_kernel(weight) if pack else None
        self.gemv_packed = self.gemv_q4 = self.gemv_q8 = None
        bf16 = self.packed is not None
        if self.gemv is None or blocks is None or not _blocks_are_weight(blocks, weight):
            blocks = None
        self.max_gemv_rows = self.gemv.max_rows() if self.gemv is not None else 0
        self.max_q8_rows = 0
        if blocks is not None and len(blocks) == 3:
            self.gemv_q4 = gguf_blocks.pack_q4_1(*blocks)
            return
        if blocks is not None:
            self.gemv_q8 = gguf_blocks.pack_q8_0(*blocks)
            self.max_q8_rows = min(BF16_Q8_MAX_ROWS, self.max_gemv_rows) if bf16 else self.max_gemv_rows
        if self.gemv is not None and bf16:
            self.gemv_packed = self.gemv.pack(weight.detach())
        elif self.gemv_q8 is None:
            self.gemv, self.max_gemv_rows = None, 0  # float32 without blocks: F.linear throughout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if x.shape[0] <= self.max_gemv_rows:
            out = x.new_empty(x.shape[0], self.weight.shape[0])
            if self.gemv_q4 is not None:
                self.gemv.linear_q4(out, x.contiguous(), *self.gemv_q4)
            elif x.shape[0] <= self.max_q8_rows:
                self.gemv.linear_q8(out, x.contiguous(), *self.gemv_q8)
            else:
                self.gemv.linear(out, x.contiguous(), self.gemv_packed)
            return out
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
