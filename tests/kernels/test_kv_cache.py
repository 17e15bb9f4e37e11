"""store_kv_cache: Triton vs reference vs a per-token loop."""

import pytest
import torch

from flexspec_kernels import store_kv_cache, store_kv_cache_ref, store_kv_cache_triton


def _loop_store(key, value, k_cache, v_cache, slot_mapping):
    """Brute force: one token at a time, block / offset spelled out."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def _case(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(device, dtype)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[torch.rand(num_tokens, generator=g) < 0.25] = -1  # padding / not-to-be-cached tokens
    return key, value, k_cache, v_cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,num_blocks,block_size",
    [(1, 1, 16, 2, 4), (13, 2, 32, 8, 4), (20, 3, 64, 4, 16)],  # 3 heads: non-power-of-two Hkv
)
def test_triton_matches_loop(num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, device):
    key, value, k_cache, v_cache, slots = _case(
        num_tokens, num_kv_heads, head_dim, num_blocks, block_size, dtype, device
    )
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _loop_store(key, value, k_expected, v_expected, slots)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache_ref(key, value, k_ref, v_ref, slots)
    store_kv_cache_triton(key, value, k_cache, v_cache, slots)

    torch.testing.assert_close(k_ref, k_expected, rtol=0, atol=0)
    torch.testing.assert_close(v_ref, v_expected, rtol=0, atol=0)
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0)


def test_skipped_tokens_leave_cache_untouched(device):
    key, value, k_cache, v_cache, _ = _case(4, 2, 16, 2, 4, torch.float32, device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.full((4,), -1, dtype=torch.int64, device=device)
    store_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_strided_key_value(device):
    """K/V as views of a fused qkv projection output (token stride > Hkv * D)."""
    num_tokens, num_kv_heads, head_dim = 6, 2, 16
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, device=device)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    assert not key.is_contiguous()
    k_cache = torch.zeros(3, 4, num_kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 5, -1, 11, 2, 7], device=device)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _loop_store(key, value, k_expected, v_expected, slots)
    store_kv_cache_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_empty_batch(device):
    key = torch.zeros(0, 2, 16, device=device)
    k_cache = torch.zeros(1, 4, 2, 16, device=device)
    slots = torch.zeros(0, dtype=torch.int64, device=device)
    store_kv_cache_triton(key, key, k_cache, k_cache.clone(), slots)


def test_dispatch():
    key, value, k_cache, v_cache, slots = _case(5, 2, 16, 2, 4, torch.float32, "cpu")
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _loop_store(key, value, k_expected, v_expected, slots)
    store_kv_cache(key, value, k_cache, v_cache, slots)  # auto on CPU -> torch reference
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    with pytest.raises(ValueError, match="backend"):
        store_kv_cache(key, value, k_cache, v_cache, slots, backend="cuda")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping"),
        (lambda a: a.update(value=a["value"].double()), "dtype"),
        (lambda a: a.update(k_cache=a["k_cache"][:, :, :1], v_cache=a["v_cache"][:, :, :1]), "heads"),
        (lambda a: a.update(v_cache=a["v_cache"].transpose(0, 1)), "v_cache"),
        (lambda a: a.update(key=a["key"][:, :, ::2], value=a["value"][:, :, ::2]), "heads/head_dim"),
    ],
)
def test_bad_arguments_raise(mutate, match):
    key, value, k_cache, v_cache, slots = _case(4, 2, 16, 2, 4, torch.float32, "cpu")
    args = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slots}
    mutate(args)
    for fn in (store_kv_cache_ref, store_kv_cache_triton):
        with pytest.raises(ValueError, match=match):
            fn(**args)
