"""Where this CPU's bf16 GEMM is slower than its float32 one (oneDNN's bf16 brgemm without AMX on some Xeons),
a bf16 product of at least float32_from_rows() rows widens weight and rows to float32 and rounds back: the
products are exact in float32 and both sum in float32, in other orders. Off unless PAGEDSERVE_BF16_F32_ROWS is N
or auto (measured): a row's result then depends on whether its step reached N rows (seeded text can differ).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from pagedserve.shared.config_error import ConfigError

log = logging.getLogger("pagedserve.worker")

PROBE_SHAPE = (256, 1024, 1024)
PROBE_REPEATS = 5
MIN_GAIN = 1.2  # float32 must beat bf16 by this much per row to be used at all
MIN_ROWS = 64  # fewer rows stay on the few-row kernels and oneDNN's bf16 path


@functools.cache
def onednn_packs_bf16() -> bool:
    """oneDNN packs bf16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; else bf16 keeps F.linear."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


def via_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float()).to(x.dtype)


@functools.cache
def float32_from_rows() -> int:
    """The fewest rows from which a bf16 product on the CPU runs via_float32; 0: never."""
    forced = os.environ.get("PAGEDSERVE_BF16_F32_ROWS", "0")
    if forced.strip() != "auto":
        if not forced.strip().isdigit():
            raise ConfigError(f"invalid PAGEDSERVE_BF16_F32_ROWS={forced!r}: a row count >= 0 (0: never) or auto")
        return int(forced)
    rows = _probe()
    log.info("bf16 products of %s rows run as float32 (this CPU's float32 GEMM is faster)", rows or "no")
    return rows


def _best_seconds(fn) -> float:
    fn()
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _probe() -> int:
    if not onednn_packs_bf16():
        return 0
    rows, k, n = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    bf16_s = _best_seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    wide = weight.float()
    float32_s = _best_seconds(lambda: F.linear(x.float(), wide).to(torch.bfloat16))
    widen_s = _best_seconds(lambda: weight.float())
    if bf16_s < MIN_GAIN * float32_s:
        return 0
    gain_per_row = (bf16_s - float32_s) / rows  # 4x the break-even below: a model's weights are not in cache
    return max(MIN_ROWS, 4 * round(widen_s / gain_per_row))
