"""Write this step's K/V into the paged KV cache by slot mapping.

Layout follows nano-vllm's ``store_kvcache`` (nano-vllm/layers/attention.py) and vLLM's
``reshape_and_cache_flash``: the cache is ``[num_blocks, block_size, Hkv, D]`` and token ``t`` goes
to flat slot ``slot_mapping[t] = block_id * block_size + offset``. A negative slot means "do not
cache this token" (padding of a CUDA-graph batch, or draft tokens that must not be kept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    v_cache_ptr,  # [num_blocks * block_size, Hkv, D] (contiguous)
    slot_mapping_ptr,  # [T] int64
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
):
    """One program per token: copy its ``Hkv x D`` key and value rows into the cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_mask = (heads < NUM_KV_HEADS)[:, None]
    token_i64 = token.to(tl.int64)

    k = tl.load(
        key_ptr + token_i64 * key_stride_t + heads[:, None] * key_stride_h + dims[None, :],
        mask=head_mask,
    )
    v = tl.load(
        value_ptr + token_i64 * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
        mask=head_mask,
    )
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, k, mask=head_mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=head_mask)


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key {(num_kv_heads, head_dim)}"
        )
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"dtype mismatch: key {key.dtype}, value {value.dtype}, "
            f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [T={num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head_dim (last) dimension")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def store_kv_cache_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
) -> None:
    """Plain-torch reference (and CPU path) of :func:`store_kv_cache`."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    keep = slot_mapping >= 0  # [T]
    if slot_mapping.device.type == "cpu" and bool(keep.all()):  # every token cached: one row copy per cache
        k_cache.view(-1, num_kv_heads * head_dim).index_copy_(0, slot_mapping, key.reshape(num_tokens, -1))
        v_cache.view(-1, num_kv_heads * head_dim).index_copy_(0, slot_mapping, value.reshape(num_tokens, -1))
        return
    slots = slot_mapping[keep]  # [T_kept]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep]


def store_kv_cache_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = skip
) -> None:
    """Triton launcher of :func:`store_kv_cache`. Slots are not range-checked (that would sync)."""
    _check_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Triton kernel, got {head_dim}")
    if num_tokens == 0:
        return
    _store_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )


def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    backend: Backend = "auto",
) -> None:
    """Write ``key``/``value`` into ``k_cache``/``v_cache`` in place.

    Token ``t`` is written to block ``slot_mapping[t] // block_size``, offset
    ``slot_mapping[t] % block_size``; tokens with ``slot_mapping[t] < 0`` are skipped.
    ``backend="auto"`` runs Triton on CUDA tensors and the torch reference otherwise.
    """
    if use_triton(backend, key):
        store_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cache_ref(key, value, k_cache, v_cache, slot_mapping)
