"""y = x @ W^T, with W packed once for oneDNN where that pays: bfloat16 on the CPU.

torch's plain bf16 F.linear on the CPU reorders the [out, in] weight into oneDNN's blocked
(AMX/AVX-512-BF16) layout on every call; for a decode step's few rows that reorder costs
as much as the product itself. Packing once at load time (mkldnn._reorder_linear_weight)
and calling mkldnn._linear_pointwise measured 1.5-3x faster per projection of SmolLM2 at
64 rows (576x576: 0.149 -> 0.041 ms; the 49152-row LM head 4.8 -> 3.1 ms), with identical
results. The batch-size hint only picks oneDNN's blocking: 64 was best or within 5% of
the best from 1 to 2048 rows (1 and 1024 were up to 2x worse at 64 rows).

float32 keeps F.linear (MKL sgemm, no reorder; and the float32 path must match HF
transformers bit for bit). PAGEDSERVE_PACK_WEIGHTS=0 turns packing off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64


def packing_enabled(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and os.environ.get("PAGEDSERVE_PACK_WEIGHTS", "1") not in ("0", "false", "no"))


class PackedLinear:
    """A projection by one [out, in] weight; packed where packing_enabled(), else F.linear."""

    def __init__(self, weight: torch.Tensor, pack: bool = True) -> None:
        self.weight = weight  # the parameter itself: the unpacked path follows its updates
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
                       if pack and packing_enabled(weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
