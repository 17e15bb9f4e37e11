"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467), with Gemma's (1 + w) variant."""

from __future__ import annotations

import torch
from torch import nn

from flexspec.layers.fused import use_fused
from flexspec_kernels.norm import rms_norm_ref, rms_norm_triton


class RMSNorm(nn.Module):
    """y = x / rms(x) * w   (or * (1 + w) when ``offset`` — Gemma). Computed in fp32, returned in x.dtype.

    On CUDA without autograd this is one Triton launch (``flexspec_kernels.norm``); otherwise the torch reference.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if use_fused(x, self.weight):
            return rms_norm_triton(x, self.weight, self.eps, self.offset)
        return rms_norm_ref(x, self.weight, self.eps, self.offset)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``residual = x + residual; return norm(residual), residual``."""
        if use_fused(x, self.weight, residual):
            return rms_norm_triton(x, self.weight, self.eps, self.offset, residual)
        return rms_norm_ref(x, self.weight, self.eps, self.offset, residual)
