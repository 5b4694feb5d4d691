"""Greedy tokens of a float32 LM head screened by its bf16 product: where the CPU computes bf16
natively the [N, V] product costs about half of float32's, and its error is bounded per row, so
the exact argmax is among the logits near the screen's maximum; cpu_head_argmax.cpp recomputes
those in float32 (double accumulation). The tokens are float32 greedy's, not bf16's.
PAGEDSERVE_SCREENED_HEAD=0 turns it off."""

from __future__ import annotations

import torch

from pagedserve.services.gpu_worker.device import cpu_has_bf16
from pagedserve.services.gpu_worker.kernels import cpu_extensions
from pagedserve.services.gpu_worker.model.bf16_gemm import onednn_packs_bf16
from pagedserve.services.gpu_worker.model.linear import PACK_BATCH_HINT, _env_on

# bf16 rounds to 8 significant bits (unit roundoff 2^-8): |h.w_v - bf16(h).bf16(w_v)| <=
# (2^-7 + 2^-16) sum_i |h_i w_vi| <= that times ||h|| ||w_v||; the float32 accumulation of
# H <= 2^12 terms adds <= 2^-12 of it, the bf16 output 2^-8 of |approx|: under 0.0121 in all.
ERROR_BOUND = 2.0**-6
MAX_HIDDEN = 2**12
# fewer rows than this take the plain head (a few-row product is bandwidth-bound, and the gemv
# kernels serve it)
MIN_ROWS = 16
# a model whose rows leave more than this share of the vocabulary to recompute (logits too close
# for bf16 to tell apart) gets the plain head from then on: recomputing would cost more than it saves
MAX_CANDIDATE_SHARE = 1 / 64


class ScreenedHead:
    """tokens(hidden [N, H] float32) -> the argmax of hidden @ weight^T per row (first on ties)."""

    def __init__(self, weight: torch.Tensor, kernel) -> None:
        self.weight = weight.detach().contiguous()  # [V, H] float32, read for the candidates
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16), PACK_BATCH_HINT)
        self.norms = self.weight.norm(dim=1)  # [V] float32
        self.kernel = kernel
        self.enabled = True  # False once a step shows the screen does not pay for this model

    @classmethod
    def build(cls, weight: torch.Tensor) -> ScreenedHead | None:
        """A screen for weight, or None where it would not pay (not float32 CPU, bf16 emulated)."""
        if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.shape[1] <= MAX_HIDDEN
                and _env_on("PAGEDSERVE_SCREENED_HEAD") and cpu_has_bf16() and onednn_packs_bf16()):
            return None
        kernel = cpu_extensions.load("head_argmax")
        return cls(weight, kernel) if kernel is not None else None

    def tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """None when a row's bound is not finite (inf or nan hidden) or the screen is off: the caller
        runs the plain head."""
        return self.tokens_and_counts(hidden)[0]

    def tokens_and_counts(self, hidden: torch.Tensor) -> tuple[list[int] | None, torch.Tensor | None]:
        """Also the candidates recomputed per row [N] (how sharp the screen is)."""
        if not self.enabled:
            return None, None
        hidden = hidden.contiguous()
        scale = ERROR_BOUND * hidden.norm(dim=1) + 1e-30  # the bound per unit of a weight row's norm
        if not bool(torch.isfinite(scale).all()):
            return None, None
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self.packed, None, "none", [], "")
        tokens, counts = self.kernel.screened_argmax(approx, hidden, self.weight, self.norms, scale)
        if float(counts.float().mean()) > MAX_CANDIDATE_SHARE * self.weight.shape[0]:
            self.enabled = False
        return tokens.tolist(), counts
