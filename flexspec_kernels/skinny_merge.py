"""The O projection of split-KV attention's unmerged partial states: the merge in the GEMV's prologue.

At one or two query rows (batch-1/2 decode) split-KV attention (``flexspec_kernels.attention_split``) would need a launch
of its own to merge its splits' partial softmax states before the O projection. :func:`skinny_merge_linear`
merges them in each program of the O GEMV (+ residual) instead (flash-decoding's reduction: Dao, Haziza, Massa,
Sizov 2023; the arithmetic of ``flexspec_kernels.attention_split``'s merge kernel), rounding the merged output to the
weight dtype before the product as the unfused path does. The QKV side of the same decode step is
``flexspec_kernels.skinny_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton
from .attention_split import MAX_SPLITS
from .pdl import launch_options, pdl_launch, pdl_wait
from .skinny_attention import GEMV_TILE, MAX_ROWS


@triton.jit
def _merge_linear_kernel(
    part_out_ptr,  # [ROWS, Hq, NUM_SPLITS, D] fp32 unnormalized partial attention outputs
    part_ml_ptr,  # [ROWS, Hq, NUM_SPLITS, 2] fp32 running max (log2 domain) and sum per split
    w_ptr,  # [N, Hq * D]
    b_ptr,  # [N] (HAS_BIAS)
    res_ptr,  # [ROWS, N] (RESIDUAL; also the output)
    out_ptr,  # [ROWS, N]
    N,
    num_q_heads,
    w_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= Hq
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    n_mask = rn < N
    h_mask = offs_h < num_q_heads
    # weight tile [BLOCK_N, BLOCK_H, D]: input feature h * D + d of output feature n
    w = tl.load(
        w_ptr
        + rn[:, None, None].to(tl.int64) * w_stride
        + offs_h[None, :, None] * HEAD_DIM
        + offs_d[None, None, :],
        mask=n_mask[:, None, None] & h_mask[None, :, None],
        other=0.0,
    ).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)  # the weights above are constant; the partial states and the residual are not
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        # [BLOCK_H, NUM_SPLITS] flat (row, head, split) index
        split_row = (m * num_q_heads + offs_h[:, None]) * NUM_SPLITS + offs_p[None, :]
        mx = tl.load(part_ml_ptr + split_row * 2, mask=h_mask[:, None], other=float("-inf"))
        ls = tl.load(part_ml_ptr + split_row * 2 + 1, mask=h_mask[:, None], other=0.0)
        acc = tl.load(
            part_out_ptr + split_row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=h_mask[:, None, None],
            other=0.0,
        )  # [BLOCK_H, NUM_SPLITS, D]
        m_max = tl.max(mx, 1)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        wgt = tl.exp2(mx - m_safe[:, None])  # 0 for splits without keys
        total = tl.sum(wgt * ls, 1)
        x = tl.sum(wgt[:, :, None] * acc, 1) / tl.where(total == 0.0, 1.0, total)[:, None]  # [BLOCK_H, D]
        x = x.to(dtype).to(tl.float32)  # the merged output's rounding, as unfused
        y = tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
        if HAS_BIAS:
            y += bias
        y = y.to(dtype)
        if RESIDUAL:
            r = tl.load(res_ptr + m * out_stride + rn, mask=n_mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + m * out_stride + rn, y, mask=n_mask)


def _check_merge_args(part_out, part_ml, weight, bias, residual) -> None:
    if part_out.dim() != 4 or part_ml.shape != (*part_out.shape[:3], 2):
        raise ValueError(
            f"part_out must be [M, Hq, P, D] and part_ml [M, Hq, P, 2], got {tuple(part_out.shape)} and "
            f"{tuple(part_ml.shape)}"
        )
    if part_out.dtype != torch.float32 or part_ml.dtype != torch.float32:
        raise ValueError(f"partial states must be float32, got {part_out.dtype} and {part_ml.dtype}")
    m, hq, _, d = part_out.shape
    if weight.dim() != 2 or weight.shape[1] != hq * d:
        raise ValueError(f"weight must be [N, Hq * D = {hq * d}], got {tuple(weight.shape)}")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != weight.dtype):
        raise ValueError(
            f"residual must be [{m}, {n}] {weight.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    devices = {t.device for t in (part_out, part_ml, weight, bias, residual) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def merge_splits_ref(part_out: torch.Tensor, part_ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Split-KV partial states ``part_out`` [M, Hq, P, D], ``part_ml`` [M, Hq, P, 2] (log2 domain) -> merged
    attention output [M, Hq, D] in ``dtype``; zeros where no split saw a key (as the merge kernel)."""
    mx, ls = part_ml[..., 0], part_ml[..., 1]
    m_max = mx.amax(-1, keepdim=True)
    w = torch.exp2(mx - torch.where(m_max == float("-inf"), 0.0, m_max))
    total = (w * ls).sum(-1, keepdim=True)
    return ((w.unsqueeze(-1) * part_out).sum(-2) / torch.where(total == 0, 1.0, total)).to(dtype)


def skinny_merge_linear_ref(
    part_out: torch.Tensor,  # [M, Hq, P, D] fp32
    part_ml: torch.Tensor,  # [M, Hq, P, 2] fp32 (log2-domain running max, sum)
    weight: torch.Tensor,  # [N, Hq * D]
    bias: torch.Tensor | None = None,  # [N]
    *,
    residual: torch.Tensor | None = None,  # [M, N], updated in place
) -> torch.Tensor:
    """Plain-torch reference of :func:`skinny_merge_linear`: merge, then the projection (+ residual)."""
    _check_merge_args(part_out, part_ml, weight, bias, residual)
    x = merge_splits_ref(part_out, part_ml, weight.dtype).reshape(part_out.shape[0], -1)
    y = torch.nn.functional.linear(x, weight, bias)
    return residual.add_(y) if residual is not None else y


def skinny_merge_linear_triton(
    part_out: torch.Tensor,  # [M, Hq, P, D] fp32, M <= MAX_ROWS, P a power of two <= attention_split.MAX_SPLITS
    part_ml: torch.Tensor,  # [M, Hq, P, 2] fp32
    weight: torch.Tensor,  # [N, Hq * D]
    bias: torch.Tensor | None = None,  # [N]
    *,
    residual: torch.Tensor | None = None,  # [M, N]: residual += y in place, and returned
    num_warps: int = 8,
) -> torch.Tensor:
    """``[residual +=] merge(part_out, part_ml) @ weight^T + bias``: the O projection of split-KV attention's
    partial softmax states (``flexspec_kernels.attention.paged_attention_triton(..., merge=False)``), merged in each
    program (flash-decoding) instead of by a launch of their own. Returns [M, N] in the weight dtype.

    Triton launcher (:func:`skinny_merge_linear` dispatches). Raises ValueError for mismatched shapes or
    dtypes, more than ``MAX_ROWS`` rows, or a split count that is not a power of two up to ``MAX_SPLITS``."""
    _check_merge_args(part_out, part_ml, weight, bias, residual)
    m, hq, p, d = part_out.shape
    if m > MAX_ROWS:
        raise ValueError(f"skinny_merge_linear handles at most {MAX_ROWS} rows, got {m}")
    if p < 1 or p & (p - 1) or p > MAX_SPLITS or d & (d - 1):
        raise ValueError(
            f"split count and head_dim must be powers of two (splits <= {MAX_SPLITS}), got {p}, {d}"
        )
    if not (part_out.is_contiguous() and part_ml.is_contiguous()) or weight.stride(1) != 1:
        raise ValueError(
            "partial states must be contiguous and weight needs unit stride along its input features"
        )
    n = weight.shape[0]
    bias = bias.contiguous() if bias is not None else None
    if residual is not None:
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous (it is updated in place)")
        out = residual
    else:
        out = torch.empty((m, n), dtype=weight.dtype, device=weight.device)
    if m == 0:
        return out
    block_h = triton.next_power_of_2(hq)
    block_n = max(1, min(64, GEMV_TILE // (block_h * d)))
    pdl = pdl_launch(weight)
    _merge_linear_kernel[(triton.cdiv(n, block_n),)](
        part_out, part_ml, weight,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        n, hq, weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, RESIDUAL=residual is not None,
        ROWS=m, HEAD_DIM=d, NUM_SPLITS=p, BLOCK_H=block_h, BLOCK_N=block_n, USE_PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out


def skinny_merge_linear(
    part_out: torch.Tensor,
    part_ml: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Split-KV merge + O projection (+ residual, in place): ``part_out`` [M, Hq, P, D] fp32, ``part_ml``
    [M, Hq, P, 2] fp32, ``weight`` [N, Hq * D], ``bias`` [N], ``residual`` [M, N] -> [M, N].
    ``backend="auto"``: Triton on CUDA tensors, else the torch reference. Both check shapes, dtypes and
    devices; only the Triton path limits rows to ``MAX_ROWS`` and needs power-of-two P (<= ``MAX_SPLITS``) and D."""
    fn = skinny_merge_linear_triton if use_triton(backend, weight) else skinny_merge_linear_ref
    return fn(part_out, part_ml, weight, bias, residual=residual)
