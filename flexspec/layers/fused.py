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


# "auto": skinny fused GEMMs (``kernels.skinny_linear``) for CUDA steps of <= MAX_ROWS tokens; "off": never;
# "torch": also on CPU, through their torch reference (tests use it to check the fused decoder's data flow).
SKINNY = os.environ.get("FLEXSPEC_SKINNY_LINEAR", "auto").lower()
if SKINNY in ("0", "false", "no"):
    SKINNY = "off"


def use_skinny(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """True when a decoder step over ``x`` [T, H] should use the skinny fused GEMMs (T <= 16 rows)."""
    from kernels.skinny_linear import MAX_ROWS

    if SKINNY == "off" or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    if SKINNY == "torch":
        return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))
    return use_fused(x, *params)
