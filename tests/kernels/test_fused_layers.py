"""Fused Triton kernels (RMSNorm + residual, RoPE, gated activation) vs their torch references."""

import pytest
import torch

from flexspec_kernels.activation import act_and_mul, act_and_mul_ref, act_and_mul_triton
from flexspec_kernels.norm import rms_norm, rms_norm_ref, rms_norm_triton
from flexspec_kernels.rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _brute_rms_norm(x, w, eps, offset):
    """Row by row in float64: the definition, not the reference's vectorised code."""
    out = torch.empty_like(x)
    for i, row in enumerate(x.double().reshape(-1, x.shape[-1])):
        rms = (row.pow(2).sum() / row.numel() + eps).sqrt()
        out.view(-1, x.shape[-1])[i] = (row / rms * (w.double() + (1.0 if offset else 0.0))).to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 100)])  # 576, 100: non-power-of-two hidden
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(shape, dtype, offset, with_residual, device):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
    w = torch.randn(shape[-1], generator=g).to(device, dtype)
    res = torch.randn(shape, generator=g).to(device, dtype) if with_residual else None
    ref = rms_norm_ref(x, w, 1e-6, offset, res)
    out = rms_norm_triton(x, w, 1e-6, offset, res)
    if with_residual:
        if x.is_cuda or dtype == torch.float32:  # the interpreter truncates fp32 -> bf16 instead of rounding
            assert torch.equal(out[1], ref[1]), "residual sum must round exactly like x + residual"
        torch.testing.assert_close(out[1], ref[1], **TOL[dtype])
        torch.testing.assert_close(out[0], ref[0], **TOL[dtype])
        s = (x + res).cpu()
        torch.testing.assert_close(ref[0].cpu(), _brute_rms_norm(s, w.cpu(), 1e-6, offset), **TOL[dtype])
    else:
        torch.testing.assert_close(out, ref, **TOL[dtype])
        torch.testing.assert_close(ref.cpu(), _brute_rms_norm(x.cpu(), w.cpu(), 1e-6, offset), **TOL[dtype])
    assert out[0].shape == x.shape if with_residual else out.shape == x.shape


def test_rms_norm_strided_rows_and_errors(device):
    base = torch.randn(6, 3 * 64, device=device)
    x = base[:, 64:128]  # a column slice: row stride 192
    w = torch.rand(64, device=device)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5, backend="triton"), rms_norm_ref(x, w, 1e-5), **TOL[torch.float32]
    )
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm_triton(x, torch.ones(63, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm_triton(x, w, 1e-5, residual=torch.zeros(6, 32, device=device))


def _brute_rope(positions, x, inv_freq):
    """Per token, per pair of dims, straight from the rotate-half definition (float64)."""
    out = torch.empty(x.shape, dtype=torch.float64)
    half = x.shape[-1] // 2
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            a = p * inv_freq[i].item()
            c, s = (
                torch.cos(torch.tensor(a, dtype=torch.float64)),
                torch.sin(torch.tensor(a, dtype=torch.float64)),
            )
            x1, x2 = x[t, :, i].double(), x[t, :, i + half].double()
            out[t, :, i] = x1 * c - x2 * s
            out[t, :, i + half] = x2 * c + x1 * s
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,hq,hkv,head_dim", [(1, 1, 1, 16), (5, 9, 3, 64), (4, 4, 2, 128)])
def test_rotary_triton_matches_reference(num_tokens, hq, hkv, head_dim, dtype, device):
    g = torch.Generator().manual_seed(1)
    max_pos = 300
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    cos, sin = freqs.cos().float().to(device), freqs.sin().float().to(device)
    # q, k as strided views of one fused QKV row, as the attention layer produces them
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * head_dim, generator=g).to(device, dtype)
    q = qkv[:, : hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(num_tokens, hkv, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(device)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cos, sin)
    q_out, k_out = rotary_embedding_triton(positions, q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
    torch.testing.assert_close(
        q_ref.cpu().double(),
        _brute_rope(positions.cpu(), q.cpu(), inv),
        **({} if dtype == torch.float32 else TOL[dtype]),
    )
    assert q_out.is_contiguous() and q_out.shape == q.shape
    q2, _ = rotary_embedding(positions, q, k, cos, sin, backend="triton")
    assert torch.equal(q2, q_out)


def test_rotary_rejects_bad_shapes(device):
    cos = torch.zeros(10, 8, device=device)
    q = torch.zeros(2, 2, 16, device=device)
    with pytest.raises(ValueError, match="positions must be int64"):
        rotary_embedding_triton(torch.zeros(2, dtype=torch.int32, device=device), q, q, cos, cos)
    with pytest.raises(ValueError, match="cos/sin must be"):
        rotary_embedding_triton(
            torch.zeros(2, dtype=torch.int64, device=device), q, q, cos[:, :4], cos[:, :4]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (6, 2 * 100), (2, 3, 2 * 2048)])
def test_act_and_mul_triton_matches_reference(shape, activation, dtype, device):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=g) * 4).to(device, dtype)
    ref = act_and_mul_ref(x, activation)
    out = act_and_mul_triton(x, activation)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    gate, up = x.double().chunk(2, dim=-1)
    if activation == "silu":
        brute = gate / (1 + torch.exp(-gate)) * up
    else:
        brute = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(ref.double(), brute, **TOL[dtype])
    assert torch.equal(act_and_mul(x, activation, backend="triton"), out)
    with pytest.raises(ValueError, match="activation must be"):
        act_and_mul(x, "relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_with_kv_store_matches_rope_then_store(dtype, device):
    from flexspec_kernels.kv_cache import store_kv_cache_ref

    g = torch.Generator().manual_seed(3)
    T, hq, hkv, D, num_blocks, block_size = 7, 9, 3, 64, 4, 4
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    cos, sin = freqs.cos().float().to(device), freqs.sin().float().to(device)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g).to(device, dtype)
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    q, k, v = q.view(T, hq, D), k.view(T, hkv, D), v.view(T, hkv, D)
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[[1, 4]] = -1  # not cached (CUDA-graph padding, FlexDraft mask tokens)
    slots = slots.to(device)
    shape = (num_blocks, block_size, hkv, D)
    k_cache, v_cache = (
        torch.randn(shape, generator=g).to(device, dtype),
        torch.randn(shape, generator=g).to(device, dtype),
    )
    k_exp, v_exp = k_cache.clone(), v_cache.clone()

    q_out, k_out = rotary_embedding_triton(positions, q, k, cos, sin, v, k_cache, v_cache, slots)
    q_ref, k_ref = rotary_embedding_triton(positions, q, k, cos, sin)
    store_kv_cache_ref(k_ref, v.contiguous(), k_exp, v_exp, slots)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(k_cache, k_exp), "cached keys must be exactly the returned rotated keys"
    assert torch.equal(v_cache, v_exp)
    with pytest.raises(ValueError, match="together"):
        rotary_embedding_triton(positions, q, k, cos, sin, v)
