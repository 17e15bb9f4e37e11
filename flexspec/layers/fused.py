"""When layers use the fused Triton kernels of ``kernels`` instead of their plain-torch code.

Fused kernels run for CUDA tensors when no gradient is needed (they have no backward; training the
drafters goes through the torch code). ``FLEXSPEC_FUSED_KERNELS=0`` turns them off, for A/B benchmarks
and for bisecting numerics; on CPU the torch code always runs (it is the kernels' reference).
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("FLEXSPEC_FUSED_KERNELS", "1").lower() not in ("0", "false", "off", "no")


def use_fused(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """True when ``x`` is on CUDA (or ROCm) and neither it nor ``params`` needs a gradient."""
    if not (ENABLED and x.is_cuda):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
