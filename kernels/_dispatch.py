"""Backend choice shared by every op's dispatcher."""

from __future__ import annotations

from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch", "torch_ref"]


def use_triton(backend: str, tensor: torch.Tensor) -> bool:
    """``"auto"``: Triton for CUDA tensors (ROCm builds report ``is_cuda`` too), torch otherwise."""
    if backend == "auto":
        return tensor.is_cuda
    if backend not in ("triton", "torch", "torch_ref"):
        raise ValueError(f"backend must be 'auto', 'triton', 'torch' or 'torch_ref', got {backend!r}")
    return backend == "triton"
