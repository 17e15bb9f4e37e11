"""Skinny GEMM (few rows) with the decoder's neighbouring ops fused in: one launch instead of two or three.

``y = x @ W^T`` for ``x`` [M, K] with M <= 16 (decode and small verification batches), one program per
BLOCK_N output features, each streaming its [BLOCK_N, K] slice of ``W`` once. Around the product:

- ``norm_weight``: RMSNorm of ``x`` first (Zhang & Sennrich, arXiv 1910.07467; ``norm_offset`` = Gemma's
  ``1 + w``), computed per row in each program (x is a few KB), rounded to the weight dtype like the
  unfused norm's output;
- ``activation`` (``"silu"`` / ``"gelu_tanh"``): ``W`` is a fused ``[gate | up]`` [2d, K] and the output is
  ``act(x W_gate^T) * (x W_up^T)`` [M, d] (SwiGLU / GeGLU), both products rounded to the output dtype
  first, as ``flexspec_kernels.activation`` does;
- ``residual`` [M, N]: ``residual += y`` in place (``y`` rounded first, then the sum rounded once, like
  ``flexspec_kernels.norm``'s fused add), so a decoder layer's residual stream is updated where it lives;
- ``capture`` (:class:`Capture`): the output rows also copied to a buffer and to a feature cache's rows by
  slot mapping (a drafter's view of target hidden states, ``flexspec.models.features``), instead of a copy,
  a concat and a scatter after the layer.

At M <= 16 a product of a 135M model's layer is ~1-4 us and bound by launch latency, not by the weights'
bytes; the unfused decoder spends 9 launches per layer (norm, QKV, RoPE, attention, O, norm, gate-up,
activation, down): with these it spends 6. The same fusion idea as vLLM's small-batch "skinny" GEMMs on
ROCm and TensorRT-LLM's fused GEMV epilogues.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, env_flag, interpreting, use_triton
from .activation import act_fn
from .pdl import launch_options, pdl_launch, pdl_wait
from .skinny_linear_torch import ACTIVATIONS, Capture, _check_args, _check_capture, skinny_linear_ref

MAX_ROWS = 16  # rows of x one launch handles (one BLOCK_M tile)
GEMV_MAX_ROWS = 2  # up to this many rows: the gemv form (H200: faster than the dot form at 1-2 rows, not 4)
# ... and with programmatic dependent launch (``flexspec_kernels.pdl``), whose next kernel loads its weight tile
# while this one finishes. H200, session 23, plain decode steps with the decode fusions up to the same row count
# (``bench/results/h200-2026-12-04-s23/rows/``): 0.88 ms at 3-4 rows against 1.00 ms in the dot form; at 6-8 rows
# the gemv form took 1.47 ms against 1.05.
GEMV_MAX_ROWS_PDL = 4
GEMV_MAX_K = 4096  # the gemv form holds a whole weight row slice [BLOCK_N, K] in registers
GEMV_TILE = 8192  # weight elements per program in the gemv form (BLOCK_N = GEMV_TILE / K, padded)
# The dot form with PDL: a program's whole 16-bit weight slice ([BLOCK_N, K], both halves with an activation)
# loaded before the wait on the previous grid, as the gemv form does, when it is at most this many bytes. H200,
# session 26 (``bench/results/h200-2026-12-05-s26/preload/``): the decoder's GEMMs at 8 / 16 rows 17.5 / 17.9 us
# per layer instead of 22.9 / 22.8, plain steps at b=8 / 16 0.91 / 0.96 ms instead of 0.99 / 1.04. fp32 weights
# keep the K loop: with preloading, 6 fp32 norm cases of the kernel tests failed on the H200 (the run was cut by
# its time limit before their messages; the tiles are twice the bf16 ones, so likely the launch's resources).
# ``FLEXSPEC_DOT_PRELOAD`` (default on) turns it off for A/B benchmarks; read at first use (``dot_preload``).
DOT_PRELOAD: bool | None = None
DOT_PRELOAD_MAX_BYTES = 64 * 1024


def dot_preload() -> bool:
    """Whether the dot form preloads 16-bit weights under PDL: ``DOT_PRELOAD`` once set, else
    ``FLEXSPEC_DOT_PRELOAD``."""
    global DOT_PRELOAD
    if DOT_PRELOAD is None:
        DOT_PRELOAD = env_flag("FLEXSPEC_DOT_PRELOAD", True)
    return DOT_PRELOAD


@triton.jit
def _store_capture(
    y, m, rn, n_mask, cap_ptr, cap_stride, cache_ptr, cache_stride, cache_col, scratch_row, slot_ptr,
    CAPTURE: tl.constexpr,
):  # fmt: skip
    """Capture epilogue: row ``m`` of the output (``y`` [BLOCK_N] at features ``rn``) to the capture buffer and,
    with CAPTURE == 2, to its feature-cache row (the scratch row for a negative slot)."""
    tl.store(cap_ptr + m * cap_stride + rn, y, mask=n_mask)
    if CAPTURE == 2:
        slot = tl.load(slot_ptr + m)
        row = tl.where(slot >= 0, slot, scratch_row)
        tl.store(
            cache_ptr + row * cache_stride + cache_col + rn, y.to(cache_ptr.dtype.element_ty), mask=n_mask
        )


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    if DOT == 0:
        return tl.dot(a, b)
    if DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _dot_epilogue(
    acc, acc_up, rm, rn, m_mask, n_mask, b_ptr, res_ptr, out_ptr, cap_ptr, cache_ptr, slot_ptr,
    res_stride, out_stride, cap_stride, cache_stride, cache_col, scratch_row,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, CAPTURE: tl.constexpr,
):  # fmt: skip
    """The tiled forms' epilogue (dot, split-K) on the fp32 sums ``acc`` [BLOCK_M, BLOCK_N] (``acc_up``: the
    up half with ACT >= 0) of rows ``rm`` and features ``rn``: bias, rounding to the output dtype, activation,
    residual add in place, the stores and the capture."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if ACT >= 0:
        a = act_fn(y.to(tl.float32), ACT).to(dtype).to(tl.float32)
        y = (a * acc_up.to(dtype).to(tl.float32)).to(dtype)
    mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:
        r_ptrs = res_ptr + rm[:, None].to(tl.int64) * res_stride + rn[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * out_stride + rn[None, :], y, mask=mask)
    if CAPTURE > 0:
        tl.store(cap_ptr + rm[:, None].to(tl.int64) * cap_stride + rn[None, :], y, mask=mask)
    if CAPTURE == 2:
        slots = tl.load(slot_ptr + rm, mask=m_mask, other=-1)
        rows = tl.where(slots >= 0, slots, scratch_row)
        tl.store(
            cache_ptr + rows[:, None] * cache_stride + cache_col + rn[None, :],
            y.to(cache_ptr.dtype.element_ty),
            mask=mask,
        )


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every row count
def _skinny_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] ([2N, K] with ACT >= 0: gate rows then up rows)
    b_ptr,  # [N] (HAS_BIAS)
    nw_ptr,  # [K] (NORM > 0)
    res_ptr,  # [M, N] (RESIDUAL; also the output)
    out_ptr,  # [M, N]
    cap_ptr,  # [M, N] (CAPTURE)
    cache_ptr,  # [num_slots + 1, C] (CAPTURE)
    slot_ptr,  # [M] int64 (CAPTURE)
    M,
    N,
    K,
    x_stride,
    w_stride,
    res_stride,
    out_stride,
    cap_stride,
    cache_stride,
    cache_col,
    scratch_row,
    eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,  # 0 none, 1 w, 2 (1 + w)
    ACT: tl.constexpr,  # -1 none, 0 silu, 1 gelu_tanh
    RESIDUAL: tl.constexpr,
    CAPTURE: tl.constexpr,  # 0 none, 1 copy to cap_ptr, 2 also the feature-cache rows
    DOT: tl.constexpr,  # 0 native (bf16/fp16), 1 exact fp32 (no TF32), 2 upcast to fp32 (interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
    PRELOAD: tl.constexpr = False,  # BLOCK_K >= K: the whole weight slice is loaded before waiting (see below)
):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * x_stride
    w_rows = w_ptr + rn[:, None].to(tl.int64) * w_stride
    # PRELOAD: one K step, whose constant weights load while the previous grid finishes (PDL), as in the gemv form
    if PRELOAD:
        w_pre = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk[None, :] < K), other=0.0)
        if ACT >= 0:
            wu_pre = tl.load(
                w_rows + N * w_stride + rk[None, :], mask=n_mask[:, None] & (rk[None, :] < K), other=0.0
            )
    pdl_wait(USE_PDL)  # x, the norm's sums and the residual come from earlier kernels
    if NORM > 0:
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K), other=0.0)
            xf = xv.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up half (ACT >= 0; unused otherwise)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_mask = kk < K
        xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM > 0:
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            if NORM == 2:
                nw = nw + 1.0
            xv = ((xv.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(w_ptr.dtype.element_ty)
        if PRELOAD:
            w = w_pre
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot(xv, tl.trans(w), DOT)
        if ACT >= 0:
            if PRELOAD:
                wu = wu_pre
            else:
                wu = tl.load(
                    w_rows + N * w_stride + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0
                )
            acc_up += _dot(xv, tl.trans(wu), DOT)
    _dot_epilogue(
        acc, acc_up, rm, rn, m_mask, n_mask, b_ptr, res_ptr, out_ptr, cap_ptr, cache_ptr, slot_ptr,
        res_stride, out_stride, cap_stride, cache_stride, cache_col, scratch_row,
        HAS_BIAS, ACT, RESIDUAL, CAPTURE,
    )  # fmt: skip


@triton.jit
def _skinny_gemv_kernel(
    x_ptr,  # [ROWS, K]
    w_ptr,  # [N, K] ([2N, K] with ACT >= 0)
    b_ptr,  # [N] (HAS_BIAS)
    nw_ptr,  # [K] (NORM > 0)
    res_ptr,  # [ROWS, N] (RESIDUAL; also the output)
    out_ptr,  # [ROWS, N]
    cap_ptr,  # [ROWS, N] (CAPTURE)
    cache_ptr,  # [num_slots + 1, C] (CAPTURE)
    slot_ptr,  # [ROWS] int64 (CAPTURE)
    N,
    K,
    x_stride,
    w_stride,
    res_stride,
    out_stride,
    cap_stride,
    cache_stride,
    cache_col,
    scratch_row,
    eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    CAPTURE: tl.constexpr,  # 0 none, 1 copy to cap_ptr, 2 also the feature-cache rows
    ROWS: tl.constexpr,  # rows of x, each reusing the weight tile held in registers
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole reduction in one load (one memory round trip per program)
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
):
    """The few-row form: each program loads its [BLOCK_N, K] weight slice once, then for every row computes
    the norm (one pass: the row is in registers) and the products as fp32 multiply + row sums."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    k_mask = rk < K
    w_tile = w_ptr + rn[:, None].to(tl.int64) * w_stride + rk[None, :]
    w = tl.load(w_tile, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if ACT >= 0:
        wu = tl.load(w_tile + N * w_stride, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if NORM > 0:
        nw = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        if NORM == 2:
            nw = nw + 1.0
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)  # the weights above are constant; x and the residual come from earlier kernels
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        xv = tl.load(x_ptr + m * x_stride + rk, mask=k_mask, other=0.0)
        xf = xv.to(tl.float32)
        if NORM > 0:
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
            xf = ((xf * rstd) * nw).to(w_ptr.dtype.element_ty).to(tl.float32)
        acc = tl.sum(w * xf[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        y = acc.to(dtype)
        if ACT >= 0:
            a = act_fn(y.to(tl.float32), ACT).to(dtype).to(tl.float32)
            up = tl.sum(wu * xf[None, :], axis=1).to(dtype)
            y = (a * up.to(tl.float32)).to(dtype)
        if RESIDUAL:
            r = tl.load(res_ptr + m * res_stride + rn, mask=n_mask, other=0.0)
            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(out_ptr + m * out_stride + rn, y, mask=n_mask)
        if CAPTURE > 0:
            _store_capture(
                y, m, rn, n_mask, cap_ptr, cap_stride, cache_ptr, cache_stride, cache_col, scratch_row, slot_ptr,
                CAPTURE,
            )  # fmt: skip


def _dot_mode(x: torch.Tensor) -> int:
    if x.dtype == torch.float32:
        return 1
    # Triton's interpreter (CPU tensors) multiplies bf16 dot operands as raw uint16 bits: upcast there.
    return 2 if (not x.is_cuda or interpreting()) else 0


def _block_n(n: int) -> int:
    """Output features per program: 16 while that leaves >= ~one program per SM, else wider."""
    if n <= 16 * 512:
        return 16
    return 32 if n <= 32 * 1024 else 64


def skinny_linear_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: bool = False,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    capture: Capture | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    variant: str | None = None,
    preload: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`skinny_linear`. ``variant``: ``"gemv"`` (whole-K weight tile in registers,
    rows looped; the default for <= ``GEMV_MAX_ROWS`` rows, ``GEMV_MAX_ROWS_PDL`` with PDL), ``"dot"``
    (tensor-core tiles over K), ``"splitk"`` (opt-in, never the default: K split over ``split_k`` programs
    per tile of features, reduced in a workspace, ``flexspec_kernels.skinny_splitk``); ``block_n`` /
    ``block_k`` / ``num_warps`` for tuning (``block_k`` is K itself, padded, in the gemv form; K per program
    in the split-K form). ``preload`` (dot form): one K step whose weight slice is loaded before the PDL
    wait; default: with PDL, for 16-bit weights whose slice fits ``DOT_PRELOAD_MAX_BYTES``, and
    :func:`dot_preload`."""
    n = _check_args(x, weight, bias, norm_weight, residual, activation)
    _check_capture(capture, x, n, activation)
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear_triton handles at most {MAX_ROWS} rows, got {m}")
    if variant not in (None, "gemv", "dot", "splitk"):
        raise ValueError(f"variant must be 'gemv', 'dot', 'splitk' or None, got {variant!r}")
    if split_k is not None and variant != "splitk":
        raise ValueError("split_k applies to variant='splitk' only")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("weight must have unit stride along K")
    if residual is not None:
        if residual.stride(1) != 1:
            raise ValueError("residual must have unit stride along N (it is updated in place)")
        out = residual
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = out
    # 1-D inputs indexed as dense by the kernels: copies only when a caller passes a strided view
    bias = bias.contiguous() if bias is not None else None
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    if capture is not None and capture.slot_mapping is not None:
        capture = capture._replace(slot_mapping=capture.slot_mapping.contiguous())
    cap_out, cache, col, slots = capture if capture is not None else (dummy, None, 0, None)
    cap_mode = 0 if capture is None else (1 if cache is None else 2)
    cache, slots = (cache, slots) if cache is not None else (dummy, dummy)
    # the kernels' common arguments: pointers, then (after the sizes) strides, then the fusion switches
    ptrs = (
        x, weight,
        bias if bias is not None else dummy,
        norm_weight if norm_weight is not None else dummy,
        residual if residual is not None else dummy,
        out, cap_out, cache, slots,
    )  # fmt: skip
    strides = (
        x.stride(0), weight.stride(0), out.stride(0), out.stride(0),
        cap_out.stride(0), cache.stride(0), col, cache.shape[0] - 1, float(eps),
    )  # fmt: skip
    flags = {
        "HAS_BIAS": bias is not None,
        "NORM": 0 if norm_weight is None else (2 if norm_offset else 1),
        "ACT": -1 if activation is None else ACTIVATIONS.index(activation),
        "RESIDUAL": residual is not None,
        "CAPTURE": cap_mode,
    }
    pdl = pdl_launch(x)
    if variant is None:
        variant = "gemv" if m <= (GEMV_MAX_ROWS_PDL if pdl else GEMV_MAX_ROWS) and k <= GEMV_MAX_K else "dot"
    if variant == "gemv":
        bk = triton.next_power_of_2(k)
        bn = block_n or max(2, min(64, GEMV_TILE // bk // (2 if activation else 1)))
        _skinny_gemv_kernel[(triton.cdiv(n, bn),)](
            *ptrs, n, k, *strides, **flags,
            ROWS=m, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl,
            num_warps=num_warps, **launch_options(pdl),
        )  # fmt: skip
        return out
    if variant == "splitk":
        from .skinny_splitk import launch_splitk  # (that module imports this one's helpers)

        launch_splitk(
            ptrs, (m, n, k), strides, flags, DOT=_dot_mode(x),
            block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps, pdl=pdl,
        )  # fmt: skip
        return out
    bn = block_n or _block_n(n)
    if preload is None:  # 16-bit weight slices (both halves with an activation) of at most the limit
        slice_bytes = triton.next_power_of_2(k) * bn * (2 if activation else 1) * 2
        preload = (
            pdl and weight.element_size() == 2 and slice_bytes <= DOT_PRELOAD_MAX_BYTES and dot_preload()
        )
    bk = triton.next_power_of_2(k) if preload else (block_k or (128 if k >= 1024 else 64))
    _skinny_linear_kernel[(triton.cdiv(n, bn),)](
        *ptrs, m, n, k, *strides, **flags,
        DOT=_dot_mode(x),
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl, PRELOAD=preload,
        num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: bool = False,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    capture: Capture | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``[residual +=] act?(rms_norm?(x) @ weight^T + bias)`` for ``x`` [M, K].

    Args:
        x: [M, K] activations (M <= ``MAX_ROWS`` on the Triton path), same dtype as ``weight``.
        weight: [N, K], or [2d, K] ``[gate | up]`` with ``activation``.
        bias: [N] or None (not with ``activation``).
        norm_weight: [K] RMSNorm weight applied to ``x`` first (``eps``, ``norm_offset``), or None.
        activation: None, ``"silu"`` or ``"gelu_tanh"``: output [M, d] = act(gate) * up.
        residual: [M, N] or None: ``residual += y`` in place and ``residual`` is returned.
        capture: :class:`Capture` or None (not with ``activation``): the result also written to
            ``capture.out`` and to ``capture.cache``'s columns ``col .. col + N`` at rows ``slot_mapping``.

    Returns:
        [M, N] (``[M, d]`` with ``activation``); ``residual`` itself when given.

    Raises:
        ValueError: mismatched shapes, dtypes or devices; more than ``MAX_ROWS`` rows on the Triton path.

    Not differentiable on the Triton path. ``backend="auto"`` runs Triton on CUDA tensors, torch otherwise.
    """
    kwargs = {
        "norm_weight": norm_weight,
        "eps": eps,
        "norm_offset": norm_offset,
        "activation": activation,
        "residual": residual,
        "capture": capture,
    }
    if use_triton(backend, x):
        return skinny_linear_triton(x, weight, bias, **kwargs)
    return skinny_linear_ref(x, weight, bias, **kwargs)
