"""Greedy tokens of a float32 LM head without its logits (cpu_head_argmax.cpp's argmax_many): the
many-row tiles' sums (cpu_f32_tiles.h), then each row's first argmax, so no [N, V] logits are
written and read back. A head in GGUF blocks takes the rows its linear_many takes, and its tokens
are those logits' argmax bit for bit; a plain float32 weight is packed [V/16, H, 16] for it and
takes MIN_ROWS rows and more (fewer keep oneDNN's head). PAGEDSERVE_GREEDY_HEAD=0 turns it off."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model.linear import PackedLinear, _env_on

MIN_ROWS = 16  # a plain float32 weight's: a lone decode row keeps the bits it had
MAX_ROWS = 1024  # a task's scratch is 3 x MAX_ROWS x 16 words


class GreedyHead:
    """tokens(hidden [N, H] float32) -> the argmax of hidden @ weight^T per row (first on ties)."""

    def __init__(self, kernel, weights: torch.Tensor, scales: torch.Tensor, min_rows: int, max_rows: int) -> None:
        self.kernel = kernel
        self.weights = weights  # int8 / uint8 GGUF blocks or float32 [V/16, H, 16]
        self.scales = scales  # the blocks' d (and m); empty for float32
        self.min_rows, self.max_rows = min_rows, max_rows

    @classmethod
    def build(cls, head: PackedLinear) -> GreedyHead | None:
        """For a float32 CPU head; None where the kernel is not built or the head does not tile."""
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
        """None outside its rows, or when a row has no logit above -inf: the caller runs the plain head."""
        rows = hidden.shape[0]
        if not self.min_rows <= rows <= self.max_rows:
            return None
        tokens = torch.empty(rows, dtype=torch.int64)
        if not self.kernel.argmax_many(tokens, hidden.contiguous(), self.weights, self.scales):
            return None
        return tokens.tolist()
