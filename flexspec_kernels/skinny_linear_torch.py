"""Plain-torch side of :mod:`flexspec_kernels.skinny_linear`: the argument checks shared by the Triton
launchers (also the batch-1 QKV + RoPE GEMV's, ``flexspec_kernels.skinny_attention``), the :class:`Capture`
target of a GEMM's output rows, and the reference (the CPU path): the unfused ops in their order."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .activation import act_and_mul_ref
from .norm import rms_norm_ref

ACTIVATIONS = ("silu", "gelu_tanh")


class Capture(NamedTuple):
    """Where a skinny GEMM also writes its output rows ``y`` [M, N] (after the residual add): ``out`` [M, N]
    (contiguous) and, with a ``cache`` [num_slots + 1, C], its columns ``col .. col + N`` at rows
    ``slot_mapping`` [>= M] int64 (negative: the last row, scratch for padding), as
    ``flexspec.models.features.FeatureCache.store`` writes them."""

    out: torch.Tensor
    cache: torch.Tensor | None = None
    col: int = 0
    slot_mapping: torch.Tensor | None = None


def _check_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
) -> int:
    """Validates shapes / dtypes / devices; returns the number of output features."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    n = weight.shape[0]
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if n % 2:
            raise ValueError(f"a [gate | up] weight needs an even row count, got {n}")
        if bias is not None or residual is not None:
            raise ValueError("activation does not combine with bias or residual")
        n //= 2
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if norm_weight is not None and norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != (x.shape[0], n) or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must be [{x.shape[0]}, {n}] {x.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    devices = {t.device for t in (x, weight, bias, norm_weight, residual) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return n


def _check_capture(capture: Capture | None, x: torch.Tensor, n: int, activation: str | None) -> None:
    if capture is None:
        return
    out, cache, col, slots = capture
    if activation is not None:
        raise ValueError("capture does not combine with activation")
    if out.shape != (x.shape[0], n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(
            f"capture.out must be contiguous [{x.shape[0]}, {n}] {x.dtype}, got {tuple(out.shape)}"
        )
    if cache is None:
        if out.device != x.device:
            raise ValueError("capture tensors must be on x's device")
        return
    if slots is None:
        raise ValueError("capture.cache needs capture.slot_mapping")
    if cache.dim() != 2 or not cache.is_contiguous() or not 0 <= col <= cache.shape[1] - n:
        raise ValueError(
            f"capture.cache must be contiguous [slots + 1, >= col + {n}], got {tuple(cache.shape)}"
        )
    if slots.shape[0] < x.shape[0] or slots.dtype != torch.int64:
        raise ValueError(
            f"capture.slot_mapping must be int64 [>= {x.shape[0]}], got {slots.dtype} {tuple(slots.shape)}"
        )
    if {t.device for t in (x, out, cache, slots)} != {x.device}:
        raise ValueError("capture tensors must be on x's device")


def _store_capture_ref(y: torch.Tensor, capture: Capture | None) -> None:
    if capture is None:
        return
    out, cache, col, slots = capture
    out.copy_(y)
    if cache is None:
        return
    slots = slots[: y.shape[0]]
    rows = torch.where(slots >= 0, slots, cache.shape[0] - 1)
    cache[:, col : col + y.shape[1]].index_copy_(0, rows, y.to(cache.dtype))


def skinny_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] ([2N, K] with activation)
    bias: torch.Tensor | None = None,  # [N]
    *,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    norm_offset: bool = False,
    activation: str | None = None,
    residual: torch.Tensor | None = None,  # [M, N], updated in place
    capture: Capture | None = None,
) -> torch.Tensor:
    """Plain-torch reference (and CPU path) of :func:`skinny_linear`: the unfused ops in their order."""
    n = _check_args(x, weight, bias, norm_weight, residual, activation)
    _check_capture(capture, x, n, activation)
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, norm_offset)
    y = F.linear(x, weight, bias)
    if activation is not None:
        return act_and_mul_ref(y, activation)
    if residual is not None:
        y = residual.add_(y)
    _store_capture_ref(y, capture)
    return y
