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
Q4_1 blocks keeps those instead (services.gpu_worker.q4_weights: 0.625 bytes a weight), so
a few-row step reads SmolLM2's layers from 66 MB instead of 212 MB, and multiplies by the
GGUF's exact weights (the float32 model's) where oneDNN's many-row path uses their bf16
roundings: a request's bf16 logits depend a little on how many rows its step has.

float32 keeps F.linear (MKL sgemm, no reorder; and the float32 path must match HF
transformers bit for bit). PAGEDSERVE_PACK_WEIGHTS=0 turns packing off (and the small-row
path with it).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from services.gpu_worker import cpu_extensions, q4_weights

PACK_BATCH_HINT = 64


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1") not in ("0", "false", "no")


def packing_enabled(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _env_on("PAGEDSERVE_PACK_WEIGHTS"))


def small_m_kernel(weight: torch.Tensor):
    """cpu_gemv's module where it serves this weight's few-row products, else None."""
    if not (packing_enabled(weight) and _env_on("PAGEDSERVE_SMALL_M_GEMV")
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0):
        return None
    gemv = cpu_extensions.load("gemv")
    return gemv if gemv is not None and gemv.supported() else None


def _q4_1_is_weight(q4_1: tuple[torch.Tensor, ...], weight: torch.Tensor) -> bool:
    """The blocks dequantize to the parameter (in its dtype) and suit the kernel's tiling."""
    q = q4_1[0]
    if q.shape != weight.shape or weight.shape[1] % 32:
        return False
    return torch.equal(q4_weights.dequantize(*q4_1).to(weight.dtype), weight.detach())


class PackedLinear:
    """A projection by one [out, in] weight; packed where packing_enabled(), else F.linear."""

    def __init__(self, weight: torch.Tensor, pack: bool = True, q4_1: tuple[torch.Tensor, ...] | None = None) -> None:
        """q4_1: the weight's GGUF blocks (services.gpu_worker.q4_weights), if it came from
        them: few-row products then read those instead of a bf16 copy."""
        self.weight = weight  # the parameter itself: the unpacked path follows its updates
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
                       if pack and packing_enabled(weight) else None)
        self.gemv = small_m_kernel(weight) if self.packed is not None else None
        self.gemv_packed = self.gemv_q4 = None
        if self.gemv is not None and q4_1 is not None and _q4_1_is_weight(q4_1, weight):
            self.gemv_q4 = self.gemv.pack_q4(*q4_1)
        elif self.gemv is not None:
            self.gemv_packed = self.gemv.pack(weight.detach())
        self.max_gemv_rows = self.gemv.max_rows() if self.gemv is not None else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if self.packed is None:
            return F.linear(x, self.weight)
        if x.shape[0] <= self.max_gemv_rows:
            out = x.new_empty(x.shape[0], self.weight.shape[0])
            if self.gemv_q4 is not None:
                self.gemv.linear_q4(out, x.contiguous(), *self.gemv_q4)
            else:
                self.gemv.linear(out, x.contiguous(), self.gemv_packed)
            return out
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
