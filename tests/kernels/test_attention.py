"""paged_attention: reference vs a naive per-query softmax, and Triton vs reference."""

import math
import os

import pytest
import torch

from flexspec_kernels import pack_masks, paged_attention, paged_attention_ref, paged_attention_triton


def _make_batch(
    ctx_lens,
    new_lens,
    *,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    block_size=4,
    dtype=torch.float32,
    device="cpu",
    masks="causal",  # "causal" (mask=None) | "random" | list of [n_s, n_s] bool
    seed=0,
):
    """Random packed batch. Unused cache blocks hold NaN and unused block-table entries are out of
    range, so reading anything outside a sequence's context shows up as NaN or a crash."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(ctx_lens)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    max_blocks = max(blocks_per_seq + [1]) + 1
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((num_seqs, max_blocks), 10**6, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"))
    v_cache = torch.full(cache_shape, float("nan"))
    used = 0
    for s, (ctx, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        ids = physical[used : used + nb]
        used += nb
        block_tables[s, :nb] = ids.int()
        k_ctx = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v_ctx = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        for i in range(ctx):
            k_cache[ids[i // block_size], i % block_size] = k_ctx[i]
            v_cache[ids[i // block_size], i % block_size] = v_ctx[i]

    num_tokens = sum(new_lens)
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(new_lens).cumsum(0)
    positions = torch.cat(
        [torch.arange(c, c + n) for c, n in zip(ctx_lens, new_lens)] + [torch.zeros(0, dtype=torch.long)]
    )
    if masks == "causal":
        mask = mask_start_loc = None
    else:
        if masks == "random":
            masks = [torch.rand(n, n, generator=g) < 0.5 for n in new_lens]
        mask, mask_start_loc = pack_masks(masks)
        mask, mask_start_loc = mask.to(device), mask_start_loc.to(device)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {
        "q": rnd(num_tokens, num_q_heads, head_dim),
        "k": rnd(num_tokens, num_kv_heads, head_dim),
        "v": rnd(num_tokens, num_kv_heads, head_dim),
        "k_cache": k_cache.to(device, dtype),
        "v_cache": v_cache.to(device, dtype),
        "block_tables": block_tables.to(device),
        "context_lens": torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        "query_start_loc": query_start_loc.to(device),
        "positions": positions.to(device),
        "scale": head_dim**-0.5,
        "mask": mask,
        "mask_start_loc": mask_start_loc,
    }


def _naive_attention(b, sliding_window=None, logits_soft_cap=None):
    """Brute force in float64: for every query token and head, list its visible keys one by one."""
    q, k, v = b["q"].double().cpu(), b["k"].double().cpu(), b["v"].double().cpu()
    k_cache, v_cache = b["k_cache"].double().cpu(), b["v_cache"].double().cpu()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k.shape[1]
    starts = b["query_start_loc"].tolist()
    positions = b["positions"].tolist()
    out = torch.zeros_like(q)
    for s, ctx in enumerate(b["context_lens"].tolist()):
        start, end = starts[s], starts[s + 1]
        n = end - start
        if b["mask"] is None:
            allowed = [[j <= i for j in range(n)] for i in range(n)]
        else:
            m0 = int(b["mask_start_loc"][s])
            allowed = b["mask"][m0 : m0 + n * n].view(n, n).tolist()
        for i in range(n):
            qp = positions[start + i]
            for h in range(q.shape[1]):
                kvh = h // group
                keys, values = [], []
                for c in range(ctx):
                    if sliding_window is None or qp - c < sliding_window:
                        blk = int(b["block_tables"][s, c // block_size])
                        keys.append(k_cache[blk, c % block_size, kvh])
                        values.append(v_cache[blk, c % block_size, kvh])
                for j in range(n):
                    kp = positions[start + j]
                    if allowed[i][j] and (sliding_window is None or qp - kp < sliding_window):
                        keys.append(k[start + j, kvh])
                        values.append(v[start + j, kvh])
                if not keys:
                    continue  # no visible key: zeros
                scores = [float(q[start + i, h] @ kk) * b["scale"] for kk in keys]
                if logits_soft_cap is not None:
                    scores = [logits_soft_cap * math.tanh(x / logits_soft_cap) for x in scores]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                out[start + i, h] = sum(w / total * vv for w, vv in zip(weights, values))
    return out


def _call(fn, b, **kw):
    return fn(**b, **kw)


# ---------------------------------------------------------------------------------------------
# the reference itself
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ctx_lens,new_lens,masks,kw",
    [
        ([5, 0, 9], [3, 1, 6], "causal", {}),
        ([5, 0, 9], [3, 2, 6], "random", {}),
        ([11, 3], [4, 5], "causal", {"sliding_window": 4}),
        ([11, 3], [4, 5], "random", {"sliding_window": 6, "logits_soft_cap": 1.5}),
        ([0, 7], [2, 0], [torch.zeros(2, 2, dtype=torch.bool), torch.zeros(0, 0, dtype=torch.bool)], {}),
    ],
)
def test_reference_matches_naive(ctx_lens, new_lens, masks, kw):
    b = _make_batch(ctx_lens, new_lens, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, masks=masks)
    expected = _naive_attention(b, **kw)
    got = paged_attention_ref(**b, **kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_no_visible_key_gives_zeros(device):
    # seq 0: no context and an all-False mask; seq 1: window so small that its query sees only itself
    masks = [torch.zeros(2, 2, dtype=torch.bool), torch.eye(1, dtype=torch.bool)]
    b = _make_batch([0, 6], [2, 1], masks=masks, device=device)
    for fn in (paged_attention_ref, paged_attention_triton):
        out = fn(**b, sliding_window=1)
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))
        torch.testing.assert_close(out[2], b["v"][2].repeat_interleave(2, dim=0))


# ---------------------------------------------------------------------------------------------
# Triton vs reference
# ---------------------------------------------------------------------------------------------

CASES = {
    # name: (ctx_lens, new_lens, batch kwargs, attention kwargs)
    "decode_gqa4": ([0, 1, 7, 16, 33, 5], [1] * 6, {"num_q_heads": 8, "num_kv_heads": 2}, {}),
    "decode_mha": ([3, 9, 17], [1, 1, 1], {"num_q_heads": 2, "num_kv_heads": 2}, {}),
    "prefill": ([0, 0], [17, 5], {}, {}),
    "chunked_prefill": ([20], [40], {"block_size": 16}, {}),
    "mixed_zero_len_seq": ([12, 4, 0, 30], [1, 0, 9, 3], {}, {}),
    "verify_tree_mask": ([9, 14], [5, 4], {"masks": "random"}, {}),
    "gqa3_non_pow2_group": ([6, 2], [3, 4], {"num_q_heads": 6, "num_kv_heads": 2}, {}),
    "block_size_3": ([10, 5], [2, 3], {"block_size": 3}, {}),
    "sliding_window": ([150, 9], [3, 12], {"block_size": 16}, {"sliding_window": 10}),
    "long_prefill_window": ([0, 4], [150, 2], {}, {"sliding_window": 20}),
    "window_and_mask": ([70], [6], {"masks": "random"}, {"sliding_window": 9}),
    "soft_cap": ([13, 2], [2, 5], {}, {"logits_soft_cap": 2.0}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name, device):
    ctx_lens, new_lens, batch_kw, attn_kw = CASES[name]
    b = _make_batch(ctx_lens, new_lens, device=device, **batch_kw)
    expected = paged_attention_ref(**b, **attn_kw)
    got = paged_attention_triton(**b, **attn_kw)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


SPLIT_CASES = {
    **CASES,
    # the default model's shape (9 query / 3 KV heads, D 64): long contexts split over several key tiles each
    "decode_long_gqa3": (
        [700, 0, 301, 64],
        [1, 1, 1, 1],
        {"num_q_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16},
        {},
    ),
    "verify_long_window": ([520, 90], [5, 3], {"block_size": 16, "masks": "random"}, {"sliding_window": 300}),
}


@pytest.mark.parametrize(
    "name,num_splits",
    [(name, 16) for name in SPLIT_CASES] + [("decode_long_gqa3", 2), ("decode_long_gqa3", 4)],
)
def test_split_kv_matches_reference(name, num_splits, device):
    """Split-KV (each program walks 1/num_splits of the context's key tiles, a second kernel merges the partial
    softmax states) == the reference, also where most splits see no key at all (short contexts, 16 splits),
    with sliding windows, custom masks on the new tokens and soft caps (the last split attends the new
    tokens)."""
    ctx_lens, new_lens, batch_kw, attn_kw = SPLIT_CASES[name]
    b = _make_batch(ctx_lens, new_lens, device=device, **batch_kw)
    expected = paged_attention_ref(**b, **attn_kw)
    got = paged_attention_triton(**b, **attn_kw, num_splits=num_splits)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_split_kv_bf16(device):
    b = _make_batch([300, 5], [1, 2], dtype=torch.bfloat16, block_size=16, device=device)
    got = paged_attention_triton(**b, num_splits=4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, paged_attention_ref(**b), rtol=2e-2, atol=2e-2)


def test_split_kv_factor_from_shapes(monkeypatch):
    """With ``FLEXSPEC_SPLIT_KV=auto``, splits double while the grid stays within four programs per SM (132 here,
    an H200), at most 16, only for queries of <= 16 tokens on CUDA; never on a CPU; ``0`` turns them off and a
    number forces that many."""
    from flexspec_kernels import attention_split

    assert attention_split.split_kv_setting() == os.environ.get(
        "FLEXSPEC_SPLIT_KV", "auto"
    )  # on unless turned off
    monkeypatch.setattr(attention_split, "SPLIT_KV", "auto")
    monkeypatch.setitem(attention_split._SM_COUNT, 0, 132)
    cuda = torch.device("cuda", 0)
    assert attention_split.num_splits_for(3, 1, cuda) == 16  # batch 1, 3 KV heads
    assert attention_split.num_splits_for(27, 1, cuda) == 16  # batch 8: 432 programs
    assert attention_split.num_splits_for(57, 1, cuda) == 8  # batch 16
    assert attention_split.num_splits_for(114, 1, cuda) == 4  # batch 32
    assert attention_split.num_splits_for(228, 1, cuda) == 2  # batch 64
    assert attention_split.num_splits_for(459, 1, cuda) == 1  # batch 128: the grid fills the GPU
    assert attention_split.num_splits_for(3, 17, cuda) == 1  # prefill-sized queries
    assert attention_split.num_splits_for(3, 1, torch.device("cpu")) == 1
    monkeypatch.setattr(attention_split, "SPLIT_KV", "0")
    assert attention_split.num_splits_for(3, 1, cuda) == 1
    monkeypatch.setattr(attention_split, "SPLIT_KV", "4")
    assert attention_split.num_splits_for(228, 1, cuda) == 4
    assert [attention_split.parse_split_kv(v) for v in (" Auto", "0", "16", "08")] == ["auto", "0", "16", "8"]
    for bad in ("3", "32", "-2", "on"):
        with pytest.raises(ValueError, match="FLEXSPEC_SPLIT_KV"):
            attention_split.parse_split_kv(bad)
    b = _make_batch([5], [1])
    with pytest.raises(ValueError, match="power of two"):
        paged_attention_triton(**b, num_splits=3)


@pytest.mark.parametrize("max_query_len", [None, 1, 150, 300])
def test_tile_size_hint_does_not_change_result(max_query_len, device):
    """The hint only picks BLOCK_M; a wrong hint (1 for a 150-token chunk) must still be exact.
    150 tokens also reach the causal kernel's unmasked (before-the-diagonal) key tiles."""
    b = _make_batch([6, 0, 3], [150, 1, 7], device=device)
    expected = paged_attention_ref(**b)
    got = paged_attention_triton(**b, max_query_len=max_query_len)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim, device):
    b = _make_batch([5, 0], [1, 4], num_q_heads=2, num_kv_heads=1, head_dim=head_dim, device=device)
    torch.testing.assert_close(paged_attention_triton(**b), paged_attention_ref(**b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("masks", ["causal", "random"])
def test_bf16(masks, device):
    b = _make_batch([9, 3], [4, 6], dtype=torch.bfloat16, masks=masks, device=device)
    got = paged_attention_triton(**b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, paged_attention_ref(**b), rtol=2e-2, atol=2e-2)


def test_strided_qkv(device):
    """q / k / v as views of one fused projection output."""
    b = _make_batch([4, 8], [3, 2], num_q_heads=4, num_kv_heads=2, device=device)
    qkv = torch.cat([b["q"], b["k"], b["v"]], dim=1)  # [T, Hq + 2 Hkv, D]
    b.update(q=qkv[:, :4], k=qkv[:, 4:6], v=qkv[:, 6:])
    assert not b["q"].is_contiguous()
    torch.testing.assert_close(paged_attention_triton(**b), paged_attention_ref(**b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_vectorized_torch_path_matches_reference(name):
    """The CPU path (one batched SDPA) must equal the per-sequence reference on every case."""
    from flexspec_kernels.attention_torch import paged_attention_torch

    ctx_lens, new_lens, batch_kw, attn_kw = CASES[name]
    b = _make_batch(ctx_lens, new_lens, **batch_kw)
    torch.testing.assert_close(paged_attention_torch(**b, **attn_kw), paged_attention_ref(**b, **attn_kw))


def test_vectorized_torch_path_no_visible_key_gives_zeros():
    from flexspec_kernels.attention_torch import paged_attention_torch

    masks = [torch.zeros(2, 2, dtype=torch.bool), torch.eye(1, dtype=torch.bool)]
    b = _make_batch([0, 6], [2, 1], masks=masks)
    out = paged_attention_torch(**b, sliding_window=1)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    torch.testing.assert_close(out, paged_attention_ref(**b, sliding_window=1))


def test_dispatch():
    b = _make_batch([3], [2])
    torch.testing.assert_close(paged_attention(**b), paged_attention_ref(**b))
    torch.testing.assert_close(
        paged_attention(**b, backend="torch_ref"), paged_attention_ref(**b), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="backend"):
        paged_attention(**b, backend="flash")


def test_pack_masks():
    m0 = torch.tensor([[True, False], [True, True]])
    m1 = torch.tensor([[False]])
    mask, start = pack_masks([m0, torch.zeros(0, 0, dtype=torch.bool), m1])
    assert mask.tolist() == [True, False, True, True, False]
    assert start.tolist() == [0, 4, 4, 5] and start.dtype == torch.int64
    with pytest.raises(ValueError, match="square"):
        pack_masks([torch.ones(2, 3, dtype=torch.bool)])


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b.update(q=b["q"][:, :3]), "multiple"),
        (lambda b: b.update(block_tables=b["block_tables"].long()), "block_tables"),
        (lambda b: b.update(positions=b["positions"].int()), "positions"),
        (lambda b: b.update(query_start_loc=b["query_start_loc"][:-1]), "query_start_loc"),
        (lambda b: b.update(mask=torch.ones(4, dtype=torch.bool)), "together"),
        (lambda b: b.update(k=b["k"].half(), v=b["v"].half()), "dtype"),
        (lambda b: b.update(sliding_window=0), "sliding_window"),
    ],
)
def test_bad_arguments_raise(mutate, match):
    b = _make_batch([3, 1], [2, 1])
    mutate(b)
    for fn in (paged_attention_ref, paged_attention_triton):
        with pytest.raises(ValueError, match=match):
            fn(**b)


def test_triton_rejects_non_pow2_head_dim():
    b = _make_batch([3], [2], head_dim=48)
    paged_attention_ref(**b)  # the reference handles any head_dim
    with pytest.raises(ValueError, match="power-of-two"):
        paged_attention_triton(**b)


@pytest.mark.gpu
@pytest.mark.parametrize("masks", ["causal", "random"])
def test_realistic_mixed_batch_on_gpu(masks):
    """bf16, D=128, GQA 32/8, block_size 16: long-context decodes, verify groups and a 512-token
    chunk in one batch, compiled for the GPU."""
    ctx_lens, new_lens = [1000, 3000, 17, 0, 2048, 700], [1, 1, 8, 512, 8, 1]
    b = _make_batch(
        ctx_lens, new_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, masks=masks, device="cuda",
    )  # fmt: skip
    for kw in ({}, {"sliding_window": 600, "logits_soft_cap": 30.0}):
        expected = paged_attention_ref(**b, **kw)
        for max_query_len in (None, 512):
            got = paged_attention(**b, max_query_len=max_query_len, **kw)  # auto -> Triton on CUDA
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_mixed_graph_layout(device):
    """``MixedGraphs``' layout: real sequences (decode, verification, prefill), one dummy sequence holding the
    pad tokens (context 0), then empty sequences, with the tile sizes of the graph's whole token count."""
    b = _make_batch([12, 4, 0, 0, 0, 0], [1, 9, 14, 40, 0, 0], device=device)
    expected = paged_attention_ref(**b)
    got = paged_attention_triton(**b, max_query_len=64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_step_cache_is_shared_by_layers_and_keyed_by_the_metadata():
    """The vectorized torch path derives gather indices and the mask once per step (``step_cache``): a second
    layer reuses them, and metadata with another mask (``dataclasses.replace``d, same dict) gets its own."""
    b = _make_batch([12, 4, 0], [3, 5, 7], masks="random")
    cache: dict = {}
    first = paged_attention(**b, backend="torch", step_cache=cache)
    torch.testing.assert_close(first, paged_attention_ref(**b), rtol=1e-5, atol=1e-5)
    again = paged_attention(**b, backend="torch", step_cache=cache)
    assert torch.equal(again, first) and sum(map(len, cache.values())) == 1
    causal = {**b, "mask": None, "mask_start_loc": None}
    got = paged_attention(**causal, backend="torch", step_cache=cache)
    torch.testing.assert_close(got, paged_attention_ref(**causal), rtol=1e-5, atol=1e-5)
    assert sum(map(len, cache.values())) == 2


def _stored_batch(ctx_lens, new_lens, **kw):
    """A batch as the engine's layers hand it over: block tables with room for the new tokens, whose K/V were
    just written to the cache (``store_kv_cache``) at their sequence's next positions; returns (batch, slots)."""
    from flexspec_kernels import store_kv_cache

    b = _make_batch([c + n for c, n in zip(ctx_lens, new_lens)], new_lens, **kw)
    bsz = b["k_cache"].shape[1]
    pos = [torch.arange(c, c + n) for c, n in zip(ctx_lens, new_lens)]
    tables = b["block_tables"].long()
    slots = torch.cat([tables[s, p // bsz] * bsz + p % bsz for s, p in enumerate(pos)]).long()
    b["context_lens"] = torch.tensor(ctx_lens, dtype=torch.int32)
    b["positions"] = torch.cat(pos + [torch.zeros(0, dtype=torch.long)])
    nan = torch.full_like(b["k_cache"].view(-1, *b["k_cache"].shape[2:])[0], float("nan"))
    for s, (c, n) in enumerate(zip(ctx_lens, new_lens)):  # positions past the context are not cached yet
        for p in range(c, c + n):
            b["k_cache"][tables[s, p // bsz], p % bsz] = nan
            b["v_cache"][tables[s, p // bsz], p % bsz] = nan
    store_kv_cache(b["k"], b["v"], b["k_cache"], b["v_cache"], slots)
    return b, slots


@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_reading_new_tokens_from_the_cache_matches_reference(name):
    """With ``slot_mapping`` the CPU path gathers context and new tokens from the cache in one pass (the merged
    plan) wherever every sequence has new tokens at its next positions; the result equals the reference. Unused
    cache entries hold NaN, so a read outside a sequence's keys shows."""
    from flexspec_kernels.attention_torch import paged_attention_torch

    ctx_lens, new_lens, batch_kw, attn_kw = CASES[name]
    b, slots = _stored_batch(ctx_lens, new_lens, **batch_kw)
    cache: dict = {}
    got = paged_attention_torch(**b, **attn_kw, step_cache=cache, slot_mapping=slots)
    torch.testing.assert_close(got, paged_attention_ref(**b, **attn_kw))
    (plan,) = [p for entries in cache.values() for _, p in entries]
    assert bool(plan.get("merged")) == (min(new_lens) > 0), plan.keys()


@pytest.mark.parametrize("change", ["slot_not_cached", "shifted_positions", "other_slot"])
def test_torch_path_falls_back_when_new_tokens_are_not_at_their_next_slots(change):
    """Mask tokens that are not cached (slot -1), drafting groups at shifted positions, or a token cached
    elsewhere than its position's slot: the new tokens' K/V come from ``k`` / ``v`` (the gathering plan)."""
    from flexspec_kernels.attention_torch import paged_attention_torch

    b, slots = _stored_batch([9, 14], [5, 4], masks="random")
    slots = slots.clone()
    if change == "slot_not_cached":
        slots[2] = -1
    elif change == "shifted_positions":
        b["positions"] = b["positions"] + 1
    else:
        slots[6] = slots[7]
    cache: dict = {}
    got = paged_attention_torch(**b, step_cache=cache, slot_mapping=slots)
    torch.testing.assert_close(got, paged_attention_ref(**b))
    (plan,) = [p for entries in cache.values() for _, p in entries]
    assert "merged" not in plan
