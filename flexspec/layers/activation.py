"""Gated MLP activations over a fused [gate | up] tensor (one Triton launch on CUDA, ``flexspec_kernels.activation``)."""

from __future__ import annotations

import torch
from torch import nn

from flexspec.layers.fused import use_fused
from flexspec_kernels.activation import act_and_mul_ref, act_and_mul_triton


class SiluAndMul(nn.Module):
    """[..., 2d] -> [..., d]: silu(gate) * up (SwiGLU, Shazeer arXiv 2002.05202)."""

    activation = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return act_and_mul_triton(x, self.activation)
        return act_and_mul_ref(x, self.activation)


class GeluTanhAndMul(SiluAndMul):
    """[..., 2d] -> [..., d]: gelu_tanh(gate) * up (GeGLU, used by Gemma)."""

    activation = "gelu_tanh"
