"""RMSNorm with an optional fused residual add, one program per row.

``y = x / rms(x) * w`` (Zhang & Sennrich, arXiv 1910.07467), or ``* (1 + w)`` with ``offset`` (Gemma).
With ``residual`` it computes ``r = x + residual`` (rounded to ``x.dtype``, as the unfused torch code
does) and returns ``(norm(r), r)``: vLLM's ``fused_add_rms_norm``, but out of place so callers keep
the functional style. Replaces ~10 elementwise launches per call with one, which is most of what a
batch-1 decode step of a small model spends (each launch ~2-3 us even inside a CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, H]
    res_ptr,  # [N, H] (HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [N, H]
    res_out_ptr,  # [N, H] (HAS_RESIDUAL)
    x_stride,
    res_stride,
    out_stride,
    res_out_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= n_cols
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    y = (xf * rstd) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [H={x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(residual.shape)}, "
            f"{residual.dtype}"
        )
    devices = {t.device for t in (x, weight, residual) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def rms_norm_ref(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    offset: bool = False,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (and CPU path) of :func:`rms_norm`: fp32 math, result in ``x.dtype``."""
    _check_args(x, weight, residual)
    if residual is not None:
        residual = x + residual
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    if offset:
        w = w + 1.0
    y = (xf * w).to(x.dtype)
    return y if residual is None else (y, residual)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    offset: bool = False,
    residual: torch.Tensor | None = None,  # [..., H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`rms_norm`; outputs are new contiguous tensors."""
    _check_args(x, weight, residual)
    shape, hidden = x.shape, x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out  # dummies, never read
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None,
            OFFSET=bool(offset),
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=4 if hidden <= 2048 else 8,
        )  # fmt: skip
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    offset: bool = False,
    residual: torch.Tensor | None = None,  # [..., H]
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension; with ``residual`` returns ``(norm(x + residual), x + residual)``.

    Not differentiable on the Triton path: callers that need gradients use ``backend="torch"``.
    ``backend="auto"`` runs Triton on CUDA tensors and the torch reference otherwise.
    """
    if use_triton(backend, x):
        return rms_norm_triton(x, weight, eps, offset, residual)
    return rms_norm_ref(x, weight, eps, offset, residual)
