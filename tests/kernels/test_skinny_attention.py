"""The decode GEMVs around attention (``flexspec_kernels.skinny_attention``, ``flexspec_kernels.skinny_merge``) vs their unfused references: QKV + RoPE +
KV-cache write, and split-KV merge + O projection fed by the attention kernel's real partial states."""

import pytest
import torch

from flexspec_kernels.attention import paged_attention_triton
from flexspec_kernels.attention_split import SplitKVPartials
from flexspec_kernels.skinny_attention import (
    MAX_ROWS,
    skinny_qkv_rope,
    skinny_qkv_rope_ref,
    skinny_qkv_rope_triton,
)
from flexspec_kernels.skinny_merge import (
    merge_splits_ref,
    skinny_merge_linear,
    skinny_merge_linear_ref,
    skinny_merge_linear_triton,
)

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-4}, torch.bfloat16: {"rtol": 2e-2, "atol": 4e-2}}


def _rope_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return f.cos().float(), f.sin().float()


def _brute_qkv_rope(x, w, b, nw, positions, cos, sin, hq, hkv, eps=1e-6):
    """float64, from the definitions: RMSNorm, x W^T + b, rotate-half RoPE on the q and k heads."""
    x = x.double()
    x = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * nw.double()
    y = x @ w.double().t() + (b.double() if b is not None else 0.0)
    d = w.shape[0] // (hq + 2 * hkv)
    half = d // 2
    out = y.clone()
    for t, p in enumerate(positions.tolist()):
        c, s = cos[p].double(), sin[p].double()
        for h in range(hq + hkv):
            x1, x2 = y[t, h * d : h * d + half], y[t, h * d + half : (h + 1) * d]
            out[t, h * d : h * d + half] = x1 * c - x2 * s
            out[t, h * d + half : (h + 1) * d] = x2 * c + x1 * s
    return out


_SMALL = [(4, 2, 16, 70), (2, 1, 128, 96)]  # (Hq, Hkv, D, K): non-power-of-two K, D = 128
QKV_CASES = [
    # the default model's layer (slow under the interpreter: two combinations)
    (9, 3, 64, 576, 2, False, torch.bfloat16),
    (9, 3, 64, 576, 1, True, torch.float32),
    *[(*shape, rows, bias, dtype) for shape in _SMALL for rows in (1, 2) for bias in (False, True)
      for dtype in (torch.float32, torch.bfloat16)],
    # 3-4 rows: batch 3-4 decode takes the fusions with programmatic dependent launch
    (*_SMALL[0], 3, True, torch.float32), (*_SMALL[1], MAX_ROWS, False, torch.bfloat16),
]  # fmt: skip


@pytest.mark.parametrize("hq,hkv,head_dim,k,rows,bias,dtype", QKV_CASES)
def test_qkv_rope_triton_matches_reference(hq, hkv, head_dim, k, rows, bias, dtype, device):
    g = torch.Generator().manual_seed(rows * 100 + hq)
    n = (hq + 2 * hkv) * head_dim
    x = (torch.randn(rows, k, generator=g) * 2).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(device, dtype)
    cos, sin = (t.to(device) for t in _rope_tables(64, head_dim))
    positions = torch.tensor([5, 63, 17, 40][:rows], dtype=torch.int64, device=device)
    block_size, num_blocks = 4, 3
    caches = [
        torch.zeros(num_blocks, block_size, hkv, head_dim, dtype=dtype, device=device) for _ in range(4)
    ]
    slot_list = [6, -1, 11, 0][:rows]  # row 2: padding, not cached
    slots = torch.tensor(slot_list, dtype=torch.int64, device=device)
    args = (x, w, b, positions, cos, sin, hq, hkv)
    ref = skinny_qkv_rope_ref(*args, norm_weight=nw, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots)
    got = skinny_qkv_rope_triton(
        *args, norm_weight=nw, k_cache=caches[2], v_cache=caches[3], slot_mapping=slots
    )
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])
    brute = _brute_qkv_rope(x.cpu(), w.cpu(), None if b is None else b.cpu(), nw.cpu(), positions.cpu(),
                            cos.cpu(), sin.cpu(), hq, hkv)  # fmt: skip
    torch.testing.assert_close(
        ref.double().cpu(), brute, rtol=TOL[dtype]["rtol"], atol=4 * TOL[dtype]["atol"]
    )
    # the cache holds the rotated keys and the values of the cached rows exactly as returned, and nothing else
    q_size, kv_size = hq * head_dim, hkv * head_dim
    k_flat, v_flat = caches[2].view(-1, hkv, head_dim), caches[3].view(-1, hkv, head_dim)
    cached = {slot: row for row, slot in enumerate(slot_list) if slot >= 0}
    for slot, row in cached.items():
        assert torch.equal(k_flat[slot].reshape(-1), got[row, q_size : q_size + kv_size])
        assert torch.equal(v_flat[slot].reshape(-1), got[row, q_size + kv_size :])
    assert k_flat.abs().sum(-1).sum(-1).nonzero().flatten().tolist() == sorted(cached)
    assert v_flat.abs().sum(-1).sum(-1).nonzero().flatten().tolist() == sorted(cached)
    torch.testing.assert_close(caches[2], caches[0], **TOL[dtype])
    torch.testing.assert_close(caches[3], caches[1], **TOL[dtype])
    # without caches: the same values, nothing stored
    before = [c.clone() for c in caches[2:]]
    torch.testing.assert_close(skinny_qkv_rope_triton(*args, norm_weight=nw), got, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, caches[2:]))


def test_qkv_rope_strided_inputs(device):
    """Views with strides (positions, slot mapping, bias, norm weight taken from wider tensors) give the
    contiguous inputs' result and cache the same slots."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, k = 2, 1, 16, 40
    n = (hq + 2 * hkv) * d
    x = torch.randn(2, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device)
    bias2 = torch.randn(n, 2, generator=g).to(device)
    nw2 = (1 + 0.3 * torch.randn(k, 2, generator=g)).to(device)
    pos2 = torch.tensor([[3, 0], [5, 0]], dtype=torch.int64, device=device)
    slots2 = torch.tensor([[1, 9], [6, 9]], dtype=torch.int64, device=device)
    cos, sin = (t.to(device) for t in _rope_tables(8, d))
    outs, caches = [], []
    for strided in (True, False):
        kc, vc = (torch.zeros(2, 4, hkv, d, device=device) for _ in range(2))
        pick = (lambda t: t[:, 0]) if strided else (lambda t: t[:, 0].contiguous())
        outs.append(skinny_qkv_rope_triton(x, w, pick(bias2), pick(pos2), cos, sin, hq, hkv, norm_weight=pick(nw2),
                                           k_cache=kc, v_cache=vc, slot_mapping=pick(slots2)))  # fmt: skip
        caches.append((kc, vc))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    assert caches[0][0].view(-1, hkv, d).abs().sum((1, 2)).nonzero().flatten().tolist() == [1, 6]


def test_qkv_rope_dispatch_and_errors(device):
    x = torch.randn(1, 32, device=device)
    w = torch.randn(5 * 16, 32, device=device)
    cos, sin = (t.to(device) for t in _rope_tables(8, 16))
    pos = torch.full((1,), 3, dtype=torch.int64, device=device)
    torch.testing.assert_close(
        skinny_qkv_rope(x, w, None, pos, cos, sin, 3, 1, backend="torch"),
        skinny_qkv_rope(x, w, None, pos, cos, sin, 3, 1, backend="triton"),
        **TOL[torch.float32],
    )
    with pytest.raises(ValueError, match="not \\(Hq \\+ 2 Hkv\\) \\* D"):
        skinny_qkv_rope_triton(x, w, None, pos, cos, sin, 2, 2)
    r = MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_qkv_rope_triton(torch.randn(r, 32, device=device), w, None, pos.repeat(r), cos, sin, 3, 1)
    with pytest.raises(ValueError, match="positions must be int64"):
        skinny_qkv_rope_triton(x, w, None, pos.int(), cos, sin, 3, 1)
    kc = torch.zeros(2, 4, 1, 16, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="together"):
        skinny_qkv_rope_triton(x, w, None, pos, cos, sin, 3, 1, k_cache=kc)
    with pytest.raises(ValueError, match="together"):  # a V cache alone would silently cache nothing
        skinny_qkv_rope(x, w, None, pos, cos, sin, 3, 1, v_cache=kc, slot_mapping=slots, backend="torch")
    with pytest.raises(ValueError, match="both be"):
        skinny_qkv_rope_triton(x, w, None, pos, cos, sin, 3, 1, k_cache=kc, v_cache=kc[:, :, :, :8],
                               slot_mapping=slots)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous"):
        skinny_qkv_rope_triton(x, w, None, pos, cos, sin, 3, 1, k_cache=kc, v_cache=torch.zeros(2, 4, 2, 16, device=device)[:, :, :1],
                               slot_mapping=slots)  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        skinny_qkv_rope(x, w, None, pos, cos.half(), sin.half(), 3, 1, backend="torch")
    with pytest.raises(ValueError, match="bias must be"):
        skinny_qkv_rope(x, w, torch.zeros(80, device=device).half(), pos, cos, sin, 3, 1, backend="torch")
    w24 = torch.randn(5 * 24, 32, device=device)
    cos24, sin24 = (t.to(device) for t in _rope_tables(8, 24))
    with pytest.raises(ValueError, match="power of two"):  # D = 24: the Triton path only
        skinny_qkv_rope_triton(x, w24, None, pos, cos24, sin24, 3, 1)


def _split_partials(num_splits, rows, hq, hkv, head_dim, ctx_lens, dtype, device):
    """Real partial states: the paged attention kernel over a random cache, unmerged, and its merged output."""
    g = torch.Generator().manual_seed(num_splits + rows)
    block_size = 16
    blocks_per_seq = max(ctx_lens) // block_size + 1
    num_blocks = rows * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(device, dtype)
    q = torch.randn(rows, hq, head_dim, generator=g).to(device, dtype)
    k = torch.randn(rows, hkv, head_dim, generator=g).to(device, dtype)
    v = torch.randn(rows, hkv, head_dim, generator=g).to(device, dtype)
    meta = {
        "block_tables": torch.arange(num_blocks, dtype=torch.int32, device=device).view(rows, -1),
        "context_lens": torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(rows + 1, dtype=torch.int32, device=device),
        "positions": torch.tensor(ctx_lens, dtype=torch.int64, device=device),
    }
    args = (q, k, v, k_cache, v_cache, meta["block_tables"], meta["context_lens"], meta["query_start_loc"])
    kw = {"scale": head_dim**-0.5, "max_query_len": 1, "num_splits": num_splits}
    parts = paged_attention_triton(*args, meta["positions"], merge=False, **kw)
    merged = paged_attention_triton(*args, meta["positions"], **kw)
    return parts, merged


# (num_splits, rows): every pair of split count and row count, each with both epilogues and dtypes except the
# slowest under the interpreter (16 splits x MAX_ROWS rows), which runs once
MERGE_CASES = [
    (splits, rows, bias, residual, dtype)
    for splits, rows in ((2, 1), (16, 1), (2, 2), (16, 2), (2, MAX_ROWS))
    for bias, residual in ((False, True), (True, False))
    for dtype in (torch.float32, torch.bfloat16)
] + [(16, MAX_ROWS, False, True, torch.bfloat16)]


@pytest.mark.parametrize("num_splits,rows,bias,residual,dtype", MERGE_CASES)
def test_merge_linear_matches_merged_attention_then_linear(num_splits, rows, bias, residual, dtype, device):
    hq, hkv, head_dim, n = 9, 3, 64, 40
    # 5 tokens of context under 16 splits: most splits see no key (their partial state is empty)
    parts, merged = _split_partials(
        num_splits, rows, hq, hkv, head_dim, [70, 5, 33, 130][:rows], dtype, device
    )
    assert isinstance(parts, SplitKVPartials) and parts.part_out.shape == (rows, hq, num_splits, head_dim)
    # fp32: to the last bits (sums in another order); bf16: the interpreter truncates where the GPU rounds
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(merge_splits_ref(*parts, dtype), merged, **tol)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, hq * head_dim, generator=g) * (hq * head_dim) ** -0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    res = torch.randn(rows, n, generator=g).to(device, dtype) if residual else None
    want = torch.nn.functional.linear(merged.reshape(rows, -1), w, b)
    if residual:
        want = (want.float() + res.float()).to(dtype)
    ref = skinny_merge_linear_ref(*parts, w, b, residual=None if res is None else res.clone())
    got = skinny_merge_linear_triton(*parts, w, b, residual=res)
    assert got.shape == (rows, n) and got.dtype == dtype
    if residual:
        assert got.data_ptr() == res.data_ptr()  # updated in place
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_merge_linear_dispatch_and_errors(device):
    parts, _ = _split_partials(2, 1, 4, 2, 16, [20], torch.float32, device)
    w = torch.randn(8, 64, device=device)
    torch.testing.assert_close(
        skinny_merge_linear(*parts, w, backend="torch"), skinny_merge_linear(*parts, w, backend="triton")
    )
    with pytest.raises(ValueError, match="weight must be"):
        skinny_merge_linear_triton(*parts, torch.randn(8, 32, device=device))
    with pytest.raises(ValueError, match="float32"):
        skinny_merge_linear_triton(parts.part_out.half(), parts.part_ml, w)
    r = MAX_ROWS + 1
    too_many = SplitKVPartials(parts.part_out.repeat(r, 1, 1, 1), parts.part_ml.repeat(r, 1, 1, 1))
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_merge_linear_triton(*too_many, w)
    none = SplitKVPartials(parts.part_out[:, :, :0], parts.part_ml[:, :, :0])
    with pytest.raises(ValueError, match="powers of two"):
        skinny_merge_linear_triton(*none, w)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_merge_linear(*parts, w, torch.zeros(8, device=device).half(), backend="torch")
    with pytest.raises(ValueError, match="residual must be"):
        skinny_merge_linear_triton(*parts, w, residual=torch.zeros(1, 7, device=device))
    strided_bias = torch.randn(8, 2, device=device)[:, 1]
    torch.testing.assert_close(
        skinny_merge_linear_triton(*parts, w, strided_bias),
        skinny_merge_linear_triton(*parts, w, strided_bias.contiguous()),
        rtol=0,
        atol=0,
    )


def test_env_flag_values():
    """``FLEXSPEC_FUSED_DECODE`` / ``FLEXSPEC_FUSED_KERNELS`` parsing: the usual on / off spellings, unset or
    empty = the default, anything else an error naming the variable."""
    from flexspec_kernels._dispatch import EnvSettingError, env_flag

    on = [env_flag("X", False, {"X": v}) for v in ("1", "true", "ON", " yes ")]
    off = [env_flag("X", True, {"X": v}) for v in ("0", "False", "off", "no")]
    assert all(on) and not any(off)
    assert env_flag("X", True, {}) and not env_flag("X", False, {"X": ""})
    with pytest.raises(EnvSettingError, match="FLEXSPEC_FUSED_DECODE='maybe'"):
        env_flag("FLEXSPEC_FUSED_DECODE", True, {"FLEXSPEC_FUSED_DECODE": "maybe"})
