"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467), with Gemma's (1 + w) variant."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w   (or * (1 + w) when ``offset`` — Gemma). Computed in fp32, returned in x.dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        if self.offset:
            w = w + 1.0
        return (xf * w).to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused ``residual = x + residual; return norm(residual), residual``."""
        residual = x + residual
        return self(residual), residual
