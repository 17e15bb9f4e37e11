"""Rotary position embedding (Su et al., arXiv 2104.09864) of q and k in one launch.

Neox / rotate-half layout as in HF Llama: for ``x = [x1 | x2]`` (halves of the head dim),
``rope(x) = [x1 cos - x2 sin | x2 cos + x1 sin]`` with ``cos/sin[p] = cos/sin(p * inv_freq)`` looked up
at each token's position. One program per token rotates all of its query and key heads, reading the
strided views that come out of the fused QKV projection (no copies) and writing new contiguous
outputs; the unfused torch code needs ~20 launches for the same work. Optionally the same launch writes the
rotated keys and the values into the paged KV cache by slot mapping (as ``flexspec_kernels.kv_cache.store_kv_cache``;
vLLM fuses RoPE and the cache write the same way), saving one more launch per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton
from .kv_cache import _check_args as _check_store_args


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, src_stride_h, dst_stride_h, cos, sin, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    src = src_ptr + heads[:, None] * src_stride_h + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + heads[:, None] * dst_stride_h + dims[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int64
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [max_position, D/2] fp32
    sin_ptr,
    q_out_ptr,  # [T, Hq, D]
    k_out_ptr,  # [T, Hkv, D]
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    qo_stride_t,
    qo_stride_h,
    ko_stride_t,
    ko_stride_h,
    num_q_heads,
    num_kv_heads,
    v_ptr,  # [T, Hkv, D] (STORE_KV)
    v_stride_t,
    v_stride_h,
    k_cache_ptr,  # [num_slots, Hkv, D] contiguous (STORE_KV)
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64, < 0 = do not cache (STORE_KV)
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    STORE_KV: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + dims)
    sin = tl.load(sin_ptr + pos * HALF + dims)
    _rotate_heads(
        q_ptr + t * q_stride_t, q_out_ptr + t * qo_stride_t, q_stride_h, qo_stride_h, cos, sin, num_q_heads,
        HALF, BLOCK_HQ,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * k_stride_t, k_out_ptr + t * ko_stride_t, k_stride_h, ko_stride_h, cos, sin, num_kv_heads,
        HALF, BLOCK_HK,
    )  # fmt: skip
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + t)
        if slot >= 0:
            slot_base = slot * (num_kv_heads * 2 * HALF)
            # Rotated keys, by the same arithmetic as k_out above, so the cache holds exactly k_out.
            _rotate_heads(
                k_ptr + t * k_stride_t, k_cache_ptr + slot_base, k_stride_h, 2 * HALF, cos, sin, num_kv_heads,
                HALF, BLOCK_HK,
            )  # fmt: skip
            kv_heads = tl.arange(0, BLOCK_HK)
            head_dims = tl.arange(0, 2 * HALF)
            kv_mask = (kv_heads < num_kv_heads)[:, None]
            v_off = kv_heads[:, None] * v_stride_h + head_dims[None, :]
            v = tl.load(v_ptr + t * v_stride_t + v_off, mask=kv_mask)
            cache_off = kv_heads[:, None] * (2 * HALF) + head_dims[None, :]
            tl.store(v_cache_ptr + slot_base + cache_off, v, mask=kv_mask)


def _check_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[2]}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] * 2 != q.shape[2]:
        raise ValueError(f"cos/sin must be [max_position, D/2={q.shape[2] // 2}], got {tuple(cos.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int64:
        raise ValueError(
            f"positions must be int64 [T={q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}"
        )
    if q.dtype != k.dtype:
        raise ValueError(f"q and k dtypes differ: {q.dtype} vs {k.dtype}")


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_position, D/2] fp32
    sin: torch.Tensor,  # [max_position, D/2] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (and CPU path) of :func:`rotary_embedding`."""
    _check_args(positions, q, k, cos, sin)
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_embedding_triton(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], unit stride in D
    k: torch.Tensor,  # [T, Hkv, D], unit stride in D
    cos: torch.Tensor,  # [max_position, D/2] fp32, contiguous
    sin: torch.Tensor,
    v: torch.Tensor | None = None,  # [T, Hkv, D]: with the caches, also store K/V
    k_cache: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,  # [T] int64, < 0 = do not cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`rotary_embedding`; with ``v`` and the caches it also writes the rotated keys
    and the values to the cache like :func:`flexspec_kernels.kv_cache.store_kv_cache`. Positions and slots are not
    range-checked (that would sync)."""
    _check_args(positions, q, k, cos, sin)
    store = v is not None
    if store:
        if k_cache is None or v_cache is None or slot_mapping is None:
            raise ValueError("storing K/V needs v, k_cache, v_cache and slot_mapping together")
        _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    half = q.shape[2] // 2
    if half & (half - 1):
        raise ValueError(f"Triton rotary needs head_dim / 2 to be a power of two, got {half}")
    if q.stride(2) != 1 or k.stride(2) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("q/k need unit stride in head_dim and cos/sin must be contiguous")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        _rotary_kernel[(q.shape[0],)](
            positions, q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            q.shape[1], k.shape[1],
            v if store else k, (v if store else k).stride(0), (v if store else k).stride(1),
            k_cache if store else k, v_cache if store else k, slot_mapping if store else positions,
            HALF=half,
            BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            STORE_KV=store,
            num_warps=4,
        )  # fmt: skip
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_position, D/2] fp32
    sin: torch.Tensor,  # [max_position, D/2] fp32
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k), computed in fp32 and returned in q's dtype.

    Not differentiable on the Triton path. ``backend="auto"`` runs Triton on CUDA tensors (when
    ``D / 2`` is a power of two) and the torch reference otherwise.
    """
    half = q.shape[-1] // 2
    if use_triton(backend, q) and (backend == "triton" or half & (half - 1) == 0):
        return rotary_embedding_triton(positions, q, k, cos, sin)
    return rotary_embedding_ref(positions, q, k, cos, sin)
