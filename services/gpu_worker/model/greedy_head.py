"""Greedy tokens of a float32 LM head without writing its logits (cpu_head_argmax.cpp's argmax_many):
GGUF blocks take linear_many's rows, bit for bit; a float32 weight is packed [V/16, H, 16], MIN_ROWS up."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model.linear import PackedLinear, _env_on

MIN_ROWS = 16
MAX_ROWS = 1024


class GreedyHead:
    def __init__(self, kernel, weights: torch.Tensor, scales: torch.Tensor, min_rows: int, max_rows: int) -> None:
        self.kernel = kernel
        self.weights, self.scales = weights, scales  # GGUF blocks and their d (m), or float32 tiles and []
        self.min_rows, self.max_rows = min_rows, max_rows

    @classmethod
    def build(cls, head: PackedLinear) -> GreedyHead | None:
        weight = head.weight
        if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and _env_on("PAGEDSERVE_GREEDY_HEAD")):
            return None
        kernel = cpu_extensions.load("head_argmax")
        if kernel is None or not kernel.has_argmax_many():
            return None
        blocks = head.gemv_q8 if head.gemv_q8 is not None else head.gemv_q4
        if blocks is not None:
            return cls(kernel, *blocks, head.max_gemv_rows + 1, head.max_many_rows) if head.max_many_rows else None
        vocab, hidden = weight.shape
        if vocab % 16:
            return None
        tiles = weight.detach().view(vocab // 16, 16, hidden).transpose(1, 2).contiguous()
        return cls(kernel, tiles, torch.empty(0, dtype=torch.int16), MIN_ROWS, MAX_ROWS)

    def tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """hidden [N, H] -> each row's argmax (first on ties); None: the plain head's rows."""
        rows = hidden.shape[0]
        if not self.min_rows <= rows <= self.max_rows:
            return None
        tokens = torch.empty(rows, dtype=torch.int64)
        if not self.kernel.argmax_many(tokens, hidden.contiguous(), self.weights, self.scales):
            return None
        return tokens.tolist()
