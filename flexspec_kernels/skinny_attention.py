"""The decode step's two GEMVs around attention, with attention's own small launches folded in.

At one or two query rows (batch-1/2 decode) a layer's launches are latency-bound: ~1.3-3 us each whatever their
work. ``flexspec_kernels.skinny_linear`` already folds norms, activation and residual adds into the GEMVs; this module
folds the two launches left around attention:

- :func:`skinny_qkv_rope`: RMSNorm + QKV projection (the gemv form of ``flexspec_kernels.skinny_linear``) with RoPE
  (Su et al., arXiv 2104.09864, rotate-half layout) applied in the epilogue and the rotated keys and the values
  written to the paged KV cache by slot mapping (as ``flexspec_kernels.rotary``'s fused store; vLLM fuses RoPE and the
  cache write the same way). Each program computes output features in (first-half, second-half) pairs of a
  head, so both operands of a rotation are in its registers. Replaces ``flexspec_kernels.rotary``'s launch.
- ``flexspec_kernels.skinny_merge.skinny_merge_linear``: the O projection (+ residual) reading split-KV attention's
  partial softmax states instead of a merged output, merging them first. Replaces the merge launch.

Same rounding points as the unfused kernels: the QKV product is rounded to the weight dtype before RoPE, the
merged attention output before the O product, so the fused and unfused decoders agree to the last bit or
nearly (the reductions' order may differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton
from .norm import rms_norm_ref
from .pdl import launch_options, pdl_launch, pdl_wait
from .rotary import rotary_embedding_ref
from .skinny_linear import GEMV_MAX_ROWS, GEMV_MAX_ROWS_PDL
from .skinny_linear_torch import _check_args as _check_linear_args

MAX_ROWS = 4  # rows of x one launch handles (the gemv form: weight tile in registers, rows looped)
GEMV_TILE = 8192  # weight elements per program (as ``flexspec_kernels.skinny_linear``'s gemv form)


@triton.jit
def _normed_row(x_ptr, nw, k_offs, k_mask, K, eps, NORM: tl.constexpr, W_DTYPE: tl.constexpr):
    """One row of x [K] in fp32, RMS-normalized (rounded to the weight dtype like the unfused norm) when NORM."""
    xf = tl.load(x_ptr + k_offs, mask=k_mask, other=0.0).to(tl.float32)
    if NORM > 0:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / K + eps)
        xf = ((xf * rstd) * nw).to(W_DTYPE).to(tl.float32)
    return xf


@triton.jit
def _qkv_rope_kernel(
    x_ptr,  # [ROWS, K]
    w_ptr,  # [N, K], N = (Hq + 2 Hkv) * D: q rows, then k rows, then v rows
    b_ptr,  # [N] (HAS_BIAS)
    nw_ptr,  # [K] (NORM > 0)
    positions_ptr,  # [ROWS] int64
    cos_ptr,  # [max_position, HALF] fp32
    sin_ptr,
    out_ptr,  # [ROWS, N]: q and k rotated, v as projected
    k_cache_ptr,  # [num_slots, Hkv, D] contiguous (STORE_KV)
    v_cache_ptr,
    slot_mapping_ptr,  # [ROWS] int64, < 0 = do not cache (STORE_KV)
    K,
    num_q_heads,
    num_kv_heads,
    x_stride,
    w_stride,
    out_stride,
    eps,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,  # 0 none, 1 w, 2 (1 + w)
    STORE_KV: tl.constexpr,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_P: tl.constexpr,  # rotation pairs (or 2 * BLOCK_P value features) per program
    BLOCK_K: tl.constexpr,  # >= K
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
):
    pid = tl.program_id(0)
    rk = tl.arange(0, BLOCK_K)
    k_mask = rk < K
    nw = rk.to(tl.float32)  # placeholder when NORM == 0
    if NORM > 0:
        nw = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        if NORM == 2:
            nw = nw + 1.0
    w_dtype = w_ptr.dtype.element_ty
    dtype = out_ptr.dtype.element_ty
    head_size = 2 * HALF
    num_pairs = (num_q_heads + num_kv_heads) * HALF  # q and k features, as (d, d + HALF) pairs
    rope_programs = tl.cdiv(num_pairs, BLOCK_P)
    if pid < rope_programs:
        j = pid * BLOCK_P + tl.arange(0, BLOCK_P)
        valid = j < num_pairs
        head = j // HALF  # 0 .. Hq + Hkv - 1 (q heads, then k heads)
        d = j % HALF
        c1 = head * head_size + d  # feature of the first half; its partner is c1 + HALF
        mask2 = valid[:, None] & k_mask[None, :]
        w1 = tl.load(w_ptr + c1[:, None].to(tl.int64) * w_stride + rk[None, :], mask=mask2, other=0.0)
        w2 = tl.load(
            w_ptr + (c1 + HALF)[:, None].to(tl.int64) * w_stride + rk[None, :], mask=mask2, other=0.0
        )
        w1 = w1.to(tl.float32)
        w2 = w2.to(tl.float32)
        if HAS_BIAS:
            b1 = tl.load(b_ptr + c1, mask=valid, other=0.0).to(tl.float32)
            b2 = tl.load(b_ptr + c1 + HALF, mask=valid, other=0.0).to(tl.float32)
        is_k = valid & (head >= num_q_heads)
        k_off = (head - num_q_heads) * head_size + d  # offset in a cache slot's [Hkv, D] (k heads only)
        pdl_wait(USE_PDL)  # weights above; x, positions, slots and the caches after
        for m in tl.static_range(ROWS):
            xf = _normed_row(x_ptr + m * x_stride, nw, rk, k_mask, K, eps, NORM, w_dtype)
            y1 = tl.sum(w1 * xf[None, :], axis=1)
            y2 = tl.sum(w2 * xf[None, :], axis=1)
            if HAS_BIAS:
                y1 += b1
                y2 += b2
            y1 = y1.to(dtype).to(tl.float32)  # the projection's output rounding, as unfused
            y2 = y2.to(dtype).to(tl.float32)
            pos = tl.load(positions_ptr + m)
            cos = tl.load(cos_ptr + pos * HALF + d, mask=valid, other=0.0)
            sin = tl.load(sin_ptr + pos * HALF + d, mask=valid, other=0.0)
            o1 = (y1 * cos - y2 * sin).to(dtype)
            o2 = (y2 * cos + y1 * sin).to(dtype)
            tl.store(out_ptr + m * out_stride + c1, o1, mask=valid)
            tl.store(out_ptr + m * out_stride + c1 + HALF, o2, mask=valid)
            if STORE_KV:
                slot = tl.load(slot_mapping_ptr + m)
                if slot >= 0:
                    base = k_cache_ptr + slot * (num_kv_heads * head_size)
                    tl.store(base + k_off, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
                    tl.store(base + k_off + HALF, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    else:  # value features: the plain product, also stored to the V cache
        v_start = (num_q_heads + num_kv_heads) * head_size
        v_size = num_kv_heads * head_size
        # index of each of this program's features among the value features
        f = (pid - rope_programs) * (2 * BLOCK_P) + tl.arange(0, 2 * BLOCK_P)
        v_valid = f < v_size
        c = v_start + f
        w = tl.load(
            w_ptr + c[:, None].to(tl.int64) * w_stride + rk[None, :],
            mask=v_valid[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + c, mask=v_valid, other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        for m in tl.static_range(ROWS):
            xv = _normed_row(x_ptr + m * x_stride, nw, rk, k_mask, K, eps, NORM, w_dtype)
            y = tl.sum(w * xv[None, :], axis=1)
            if HAS_BIAS:
                y += b
            y = y.to(dtype)
            tl.store(out_ptr + m * out_stride + c, y, mask=v_valid)
            if STORE_KV:
                v_slot = tl.load(slot_mapping_ptr + m)
                if v_slot >= 0:
                    tl.store(
                        v_cache_ptr + v_slot * v_size + f, y.to(v_cache_ptr.dtype.element_ty), mask=v_valid
                    )


def decode_fusion_rows(x: torch.Tensor) -> int:
    """The most rows a decode step over ``x`` takes through the fused QKV + RoPE and merge + O launches: those of
    the gemv form of ``flexspec_kernels.skinny_linear`` (2, or 4 with programmatic dependent launch; measured
    together, see ``GEMV_MAX_ROWS_PDL`` there)."""
    return GEMV_MAX_ROWS_PDL if pdl_launch(x) else GEMV_MAX_ROWS


def _check_qkv_args(
    x,
    weight,
    bias,
    norm_weight,
    positions,
    cos,
    sin,
    num_q_heads,
    num_kv_heads,
    k_cache,
    v_cache,
    slot_mapping,
) -> int:
    """Validates shapes / dtypes / devices (both paths); returns head_dim."""
    _check_linear_args(x, weight, bias, norm_weight, None, None)  # x, weight, bias, norm weight
    heads = num_q_heads + 2 * num_kv_heads
    if num_q_heads < 1 or num_kv_heads < 1 or weight.shape[0] % heads:
        raise ValueError(
            f"weight rows {weight.shape[0]} are not (Hq + 2 Hkv) * D for Hq={num_q_heads}, Hkv={num_kv_heads}"
        )
    head_dim = weight.shape[0] // heads
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (x.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [{x.shape[0]}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != head_dim:
        raise ValueError(f"cos/sin must be [max_position, D/2={head_dim // 2}], got {tuple(cos.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32, got {cos.dtype} and {sin.dtype}")
    given = [t is not None for t in (k_cache, v_cache, slot_mapping)]
    if any(given) and not all(given):
        raise ValueError("storing K/V needs k_cache, v_cache and slot_mapping together")
    if all(given):
        kv_shape = (num_kv_heads, head_dim)
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or tuple(k_cache.shape[-2:]) != kv_shape:
            raise ValueError(
                f"k_cache and v_cache must both be [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
                f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("k_cache and v_cache must be contiguous")
        if slot_mapping.shape != (x.shape[0],) or slot_mapping.dtype != torch.int64:
            raise ValueError(
                f"slot_mapping must be int64 [{x.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            )
    tensors = (x, weight, bias, norm_weight, positions, cos, sin, k_cache, v_cache, slot_mapping)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return head_dim


def skinny_qkv_rope_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K]
    bias: torch.Tensor | None,  # [(Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [M] int64
    cos: torch.Tensor,  # [max_position, D/2] fp32
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    norm_offset: bool = False,
    k_cache: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,  # [M] int64, < 0 = do not cache
) -> torch.Tensor:
    """Plain-torch reference of :func:`skinny_qkv_rope`: norm, projection, RoPE and the cache write, unfused
    (any row count and even head_dim)."""
    head_dim = _check_qkv_args(
        x,
        weight,
        bias,
        norm_weight,
        positions,
        cos,
        sin,
        num_q_heads,
        num_kv_heads,
        k_cache,
        v_cache,
        slot_mapping,
    )
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps, norm_offset)
    qkv = torch.nn.functional.linear(x, weight, bias)
    m = x.shape[0]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k = rotary_embedding_ref(
        positions, q.reshape(m, num_q_heads, head_dim), k.reshape(m, num_kv_heads, head_dim), cos, sin
    )
    if k_cache is not None:
        from .kv_cache import store_kv_cache_ref

        store_kv_cache_ref(k, v.reshape(m, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping)
    return torch.cat([q.reshape(m, -1), k.reshape(m, -1), v], dim=-1)


def skinny_qkv_rope_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [(Hq + 2 Hkv) * D, K], unit stride along K
    bias: torch.Tensor | None,  # [(Hq + 2 Hkv) * D], weight's dtype
    positions: torch.Tensor,  # [M] int64
    cos: torch.Tensor,  # [max_position, D/2] fp32
    sin: torch.Tensor,  # [max_position, D/2] fp32
    num_q_heads: int,
    num_kv_heads: int,
    *,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    norm_offset: bool = False,  # Gemma's (1 + w)
    k_cache: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, D] contiguous
    slot_mapping: torch.Tensor | None = None,  # [M] int64, < 0 = do not cache
    num_warps: int = 4,
) -> torch.Tensor:
    """``[q | k | v]`` [M, (Hq + 2 Hkv) * D] = ``rms_norm?(x) @ weight^T + bias`` with RoPE applied to the q and k
    heads at ``positions``, and (with the caches) the rotated keys and the values written to the paged KV cache
    ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (negative: not cached), in one launch.

    Triton launcher (:func:`skinny_qkv_rope` dispatches). Positions and slots are not range-checked (that would
    sync); 1-D inputs are made contiguous. Raises ValueError for mismatched shapes, dtypes or devices, caches
    given without each other or ``slot_mapping``, more than ``MAX_ROWS`` rows, or a ``D / 2`` that is not a
    power of two."""
    head_dim = _check_qkv_args(
        x,
        weight,
        bias,
        norm_weight,
        positions,
        cos,
        sin,
        num_q_heads,
        num_kv_heads,
        k_cache,
        v_cache,
        slot_mapping,
    )
    m, k = x.shape
    half = head_dim // 2
    if m > MAX_ROWS:
        raise ValueError(f"skinny_qkv_rope handles at most {MAX_ROWS} rows, got {m}")
    if half & (half - 1):
        raise ValueError(f"skinny_qkv_rope needs head_dim / 2 to be a power of two, got {half}")
    store = k_cache is not None
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("weight needs unit stride along K")
    # the kernel indexes these as dense: copies only when a caller passes a strided view
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    bias = bias.contiguous() if bias is not None else None
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    slot_mapping = slot_mapping.contiguous() if slot_mapping is not None else None
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bk = triton.next_power_of_2(k)
    block_p = max(1, min(32, GEMV_TILE // bk // 2))
    num_pairs = (num_q_heads + num_kv_heads) * half
    grid = (triton.cdiv(num_pairs, block_p) + triton.cdiv(num_kv_heads * head_dim, 2 * block_p),)
    pdl = pdl_launch(x)
    _qkv_rope_kernel[grid](
        x, weight,
        bias if bias is not None else out,
        norm_weight if norm_weight is not None else out,
        positions, cos, sin, out,
        k_cache if store else out, v_cache if store else out, slot_mapping if store else positions,
        k, num_q_heads, num_kv_heads,
        x.stride(0), weight.stride(0), out.stride(0),
        float(eps),
        HAS_BIAS=bias is not None,
        NORM=0 if norm_weight is None else (2 if norm_offset else 1),
        STORE_KV=store,
        ROWS=m, HALF=half, BLOCK_P=block_p, BLOCK_K=bk, USE_PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )  # fmt: skip
    return out


def skinny_qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: bool = False,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm + QKV + RoPE (+ KV-cache write) of ``x`` [M, K] -> ``[q | k | v]`` [M, (Hq + 2 Hkv) * D]; the
    arguments' shapes are :func:`skinny_qkv_rope_triton`'s. ``backend="auto"``: Triton on CUDA tensors, else
    the torch reference. Both check shapes, dtypes and devices; only the Triton path limits rows to
    ``MAX_ROWS`` and needs a power-of-two ``D / 2``. Not differentiable on the Triton path."""
    kwargs = {
        "norm_weight": norm_weight, "eps": eps, "norm_offset": norm_offset,
        "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping,
    }  # fmt: skip
    fn = skinny_qkv_rope_triton if use_triton(backend, x) else skinny_qkv_rope_ref
    return fn(x, weight, bias, positions, cos, sin, num_q_heads, num_kv_heads, **kwargs)
