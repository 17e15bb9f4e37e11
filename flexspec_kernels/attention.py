"""Varlen paged attention with custom masks over the new tokens.

One kernel serves prefill, chunked prefill, decode, speculative verification and FlexDraft
mask-token groups. For sequence ``s`` with ``ctx = context_lens[s]`` cached tokens and ``n_s`` new
tokens, each new (query) token sees

* every cached token (positions ``0 .. ctx-1``, read from the paged cache via ``block_tables``), and
* the new tokens allowed by the custom mask (or causally, by index, when ``mask is None``),
  read straight from ``k``/``v`` (the cache need not hold them yet),

both subject to the sliding window ``q_pos - k_pos < sliding_window``. A query that sees no key
returns zeros.

The Triton kernel is FlashAttention-2 style (Dao, arXiv 2307.08691: online softmax, fp32
accumulators); its grid and GQA packing follow vLLM's ``unified_attention``
(vllm/attention/ops/triton_unified_attention.py): one program per (query tile, KV head), where a
tile holds ``BLOCK_Q`` query tokens times the ``Hq / Hkv`` query heads sharing that KV head, and the
program finds its sequence by binary search over ``query_start_loc``. The grid size is a function of
tensor shapes only (``T // BLOCK_Q + S``), never of tensor values, so launches can be captured in
CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, interpreting, use_triton
from .attention_split import SplitKVPartials, merge_splits, num_splits_for
from .attention_tiles import _attend_step_tokens, _find_seq_idx, _online_softmax_step, _scale_scores
from .attention_torch import _check_args, paged_attention_ref, paged_attention_torch
from .pdl import CHAIN_ROWS as PDL_CHAIN_ROWS
from .pdl import launch_options, pdl_launch, pdl_wait

# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_seqs", "num_q_heads", "scale", "sliding_window", "soft_cap"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [S, max_blocks_per_seq] int32
    context_lens_ptr,  # [S] int32
    query_start_loc_ptr,  # [S + 1] int32
    positions_ptr,  # [T] int64
    mask_ptr,  # [sum_s n_s * n_s] uint8 (unused unless HAS_MASK)
    mask_start_loc_ptr,  # [S + 1] int64 (unused unless HAS_MASK)
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32 unnormalized partial outputs (unused if NUM_SPLITS == 1)
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32 partial running max (log2) and sum (unused if NUM_SPLITS == 1)
    scale,  # float
    sliding_window,  # int (unused unless USE_SLIDING_WINDOW)
    soft_cap,  # float (unused unless USE_SOFT_CAP)
    num_seqs,
    num_q_heads,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    o_stride_t,
    o_stride_h,
    cache_stride_b,
    cache_stride_s,
    cache_stride_h,
    block_tables_stride,
    CACHE_BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x NUM_QUERIES_PER_KV heads (padded)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # dot in fp32: works around the interpreter's bf16 tl.dot
    NUM_SPLITS: tl.constexpr,  # split-KV: programs per (query tile, KV head), each over a share of the context
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (``flexspec_kernels.pdl``)
):
    pdl_wait(USE_PDL)  # before the early exit below: every program waits (nothing here is constant)
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return

    # Row r of the tile is query token r // G of this block, query head kv_head * G + r % G.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local = q_block_local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M] index in seq
    q_head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_local < q_len)  # [BLOCK_M]
    q_tok = (q_start + q_local).to(tl.int64)  # [BLOCK_M]

    q = tl.load(
        q_ptr + q_tok[:, None] * q_stride_t + q_head[:, None] * q_stride_h + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]
    q_pos = tl.load(positions_ptr + q_tok, mask=row_valid, other=0)  # [BLOCK_M] int64
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # ---- 1. cached context: positions 0 .. ctx_len-1, gathered through the block table ----
    ctx_len = tl.load(context_lens_ptr + seq)
    ctx_start = 0
    if USE_SLIDING_WINDOW:
        # Keys below the tile's smallest query position - window + 1 are invisible to every row.
        min_q_pos = tl.min(tl.where(row_valid, q_pos, 1 << 62))
        first_visible = tl.maximum(min_q_pos - sliding_window + 1, 0)
        ctx_start = (tl.minimum(first_visible, ctx_len) // BLOCK_N * BLOCK_N).to(tl.int32)
    ctx_end = ctx_len
    if NUM_SPLITS > 1:  # this program's share: a contiguous run of the context's key tiles
        num_tiles = tl.cdiv(ctx_len - ctx_start, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        ctx_end = tl.minimum(ctx_start + (split + 1) * tiles_per_split * BLOCK_N, ctx_len)
        ctx_start = tl.minimum(ctx_start + split * tiles_per_split * BLOCK_N, ctx_len)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * block_tables_stride
    for kv_start in range(ctx_start, ctx_end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        kv_valid = offs_n < ctx_len
        block_ids = tl.load(block_table_row + offs_n // CACHE_BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        cache_offs = (
            block_ids * cache_stride_b
            + (offs_n % CACHE_BLOCK_SIZE) * cache_stride_s
            + kv_head * cache_stride_h
        )  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr + cache_offs[None, :] + offs_d[:, None], mask=kv_valid[None, :], other=0.0
        )  # [HEAD_DIM, BLOCK_N]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = _scale_scores(
            tl.dot(q, k, input_precision="ieee"), scale, soft_cap, USE_SOFT_CAP
        )  # [BLOCK_M, BLOCK_N]
        visible = kv_valid[None, :]
        if USE_SLIDING_WINDOW:
            visible = visible & ((q_pos[:, None] - offs_n[None, :]) < sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(
            v_cache_ptr + cache_offs[:, None] + offs_d[None, :], mask=kv_valid[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        if UPCAST_DOT:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc)

    # ---- 2. this step's new tokens, read from k / v, under the custom or causal mask (by the last split) ----
    if NUM_SPLITS == 1:  # noqa: SIM114 - static: the unsplit kernel stays the code it was before split-KV
        m_i, l_i, acc = _attend_step_tokens(
            m_i, l_i, acc, q, q_local, q_pos, row_valid, seq, q_start, q_len, q_block_local, kv_head,
            k_ptr, v_ptr, positions_ptr, mask_ptr, mask_start_loc_ptr,
            k_stride_t, k_stride_h, v_stride_t, v_stride_h, scale, sliding_window, soft_cap,
            HEAD_DIM, BLOCK_Q, BLOCK_N, HAS_MASK, USE_SLIDING_WINDOW, USE_SOFT_CAP, UPCAST_DOT,
        )  # fmt: skip
    elif split == NUM_SPLITS - 1:
        m_i, l_i, acc = _attend_step_tokens(
            m_i, l_i, acc, q, q_local, q_pos, row_valid, seq, q_start, q_len, q_block_local, kv_head,
            k_ptr, v_ptr, positions_ptr, mask_ptr, mask_start_loc_ptr,
            k_stride_t, k_stride_h, v_stride_t, v_stride_h, scale, sliding_window, soft_cap,
            HEAD_DIM, BLOCK_Q, BLOCK_N, HAS_MASK, USE_SLIDING_WINDOW, USE_SOFT_CAP, UPCAST_DOT,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        # Rows without any visible key have l = 0 and acc = 0: they return zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_tok[:, None] * o_stride_t + q_head[:, None] * o_stride_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:  # partial results of this split; attention_split.merge_splits combines them
        row = (q_tok * num_q_heads + q_head) * NUM_SPLITS + split  # [BLOCK_M] flat (token, head, split)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


def _launch_config(max_query_len: int, num_queries_per_kv: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N, num_warps): small tiles for decode / verify, large for prefill."""
    rows = max(16, triton.next_power_of_2(max(max_query_len, 1) * num_queries_per_kv))
    block_m = max(min(rows, 128 if head_dim <= 128 else 64), triton.next_power_of_2(num_queries_per_kv))
    block_n = 64 if head_dim <= 128 else 32
    num_warps = 8 if block_m * head_dim >= 128 * 128 else 4
    return block_m, block_m // num_queries_per_kv, block_n, num_warps


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [T] int64
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,  # [sum_s n_s * n_s] bool
    mask_start_loc: torch.Tensor | None = None,  # [S + 1] int64
    logits_soft_cap: float | None = None,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    merge: bool = True,
) -> torch.Tensor | SplitKVPartials:  # [T, Hq, D]
    """Triton launcher of :func:`paged_attention`. Never reads tensor values on the host.

    ``max_query_len`` (largest ``n_s``) only picks tile sizes; the grid is ``T // BLOCK_Q + S``
    programs per KV head whatever it is. If None, ``ceil(T / S)`` is used as the guess.
    ``num_splits`` (a power of two; None: ``attention_split.num_splits_for``) splits each program's cached context over that
    many programs, whose partial softmax results a second kernel merges (split-KV); with ``merge=False`` a split
    launch returns them unmerged as :class:`~flexspec_kernels.attention_split.SplitKVPartials` instead (for a consumer
    that merges them itself, ``flexspec_kernels.skinny_merge.skinny_merge_linear``).
    """
    _check_args(
        q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
        sliding_window, mask, mask_start_loc, logits_soft_cap,
    )  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = block_tables.shape[0]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"Triton paged_attention needs a power-of-two head_dim >= 16, got {head_dim}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")

    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    num_queries_per_kv = num_q_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = -(-num_tokens // max(num_seqs, 1))
    block_m, block_q, block_n, num_warps = _launch_config(max_query_len, num_queries_per_kv, head_dim)

    has_mask = mask is not None
    mask_u8 = mask.view(torch.uint8) if has_mask else positions  # dummy pointer when unused
    num_q_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        num_splits = num_splits_for(num_q_tiles * num_kv_heads, max_query_len, q.device)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    part_out = part_ml = out  # dummy pointers when unused
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    grid = (num_q_tiles, num_kv_heads, num_splits)
    pdl = num_tokens <= PDL_CHAIN_ROWS and pdl_launch(q)  # decode at batch <= 4: between skinny kernels
    _paged_attention_kernel[grid](
        out, q, k, v, k_cache, v_cache,
        block_tables, context_lens, query_start_loc, positions,
        mask_u8, mask_start_loc if has_mask else positions,
        part_out, part_ml,
        float(scale),
        int(sliding_window) if sliding_window is not None else 0,
        float(logits_soft_cap) if logits_soft_cap is not None else 0.0,
        num_seqs,
        num_q_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        CACHE_BLOCK_SIZE=k_cache.shape[1],
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HAS_MASK=has_mask,
        USE_SLIDING_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        # Triton's interpreter (the only way to run on CPU tensors) multiplies bf16 dot operands
        # as their raw uint16 bits (triton/runtime/interpreter.py, create_dot), so upcast there.
        UPCAST_DOT=q.dtype == torch.bfloat16 and (not q.is_cuda or interpreting()),
        NUM_SPLITS=num_splits,
        USE_PDL=pdl,
        num_warps=num_warps,
        **launch_options(pdl),
    )  # fmt: skip
    if num_splits > 1:
        if not merge:
            return SplitKVPartials(part_out, part_ml)
        merge_splits(out, part_out, part_ml)
    return out


# ---------------------------------------------------------------------------------------------
# Dispatcher and helpers
# ---------------------------------------------------------------------------------------------


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [T] int64
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,  # [sum_s n_s * n_s] bool
    mask_start_loc: torch.Tensor | None = None,  # [S + 1] int64
    logits_soft_cap: float | None = None,
    max_query_len: int | None = None,
    backend: Backend = "auto",
    step_cache: dict | None = None,
    slot_mapping: torch.Tensor | None = None,  # [T] int64
) -> torch.Tensor:  # [T, Hq, D], dtype of q
    """Attention of this step's new tokens over their sequence's cached context and new tokens.

    Args:
        q: query tokens of this step, all sequences packed.
        k, v: K/V of this step's new tokens; attended to from here (or, with ``slot_mapping``, from the cache).
        k_cache, v_cache: paged cache; cached token ``i`` of seq ``s`` lives in block
            ``block_tables[s, i // block_size]`` at offset ``i % block_size``.
        block_tables: physical block ids per sequence (entries past the context are ignored).
        context_lens: number of cached tokens of each sequence (positions ``0 .. ctx-1``), all
            visible to every query of that sequence (subject to ``sliding_window``).
        query_start_loc: cumulative offsets of each sequence's new tokens in ``T``.
        positions: absolute position of each new token (as query and as key).
        scale: softmax scale, usually ``D ** -0.5``.
        sliding_window: key at ``kp`` is visible to query at ``qp`` only if ``qp - kp < window``.
        mask: packed custom mask (see :func:`pack_masks`); ``None`` means causal by index.
        mask_start_loc: offsets of each sequence's ``n_s x n_s`` block in ``mask``.
        logits_soft_cap: if set, ``scores = cap * tanh(scores / cap)`` (Gemma 2).
        max_query_len: largest ``n_s``; only a tile-size hint for the Triton path.
        step_cache: a dict that lives for one step (all layers see the same metadata): the vectorized torch
            path keeps the gather indices and visibility mask it derives from the metadata there.
        slot_mapping: where ``k`` / ``v`` were written to the cache before this call (``< 0``: not written); the
            vectorized torch path then reads them from there when every new token sits at its sequence's next
            position (one gather for context and new tokens). The Triton paths ignore it.
        backend: ``"auto"`` (Triton on CUDA, vectorized torch otherwise), ``"triton"``, ``"torch"``
            (vectorized, :mod:`flexspec_kernels.attention_torch`) or ``"torch_ref"`` (per-sequence reference).
    """
    if use_triton(backend, q):
        return paged_attention_triton(
            q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
            scale, sliding_window, mask, mask_start_loc, logits_soft_cap, max_query_len,
        )  # fmt: skip
    if backend == "torch_ref":
        return paged_attention_ref(
            q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
            scale, sliding_window, mask, mask_start_loc, logits_soft_cap,
        )  # fmt: skip
    _check_args(
        q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
        sliding_window, mask, mask_start_loc, logits_soft_cap,
    )  # fmt: skip
    return paged_attention_torch(
        q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
        scale, sliding_window, mask, mask_start_loc, logits_soft_cap, step_cache, slot_mapping,
    )  # fmt: skip


def pack_masks(
    masks: list[torch.Tensor],  # S x [n_s, n_s] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # ([sum_s n_s * n_s] bool, [S + 1] int64)
    """Pack per-sequence ``[n_s, n_s]`` masks (``[i, j]`` = query i sees new token j) for
    :func:`paged_attention`. Returns ``(mask, mask_start_loc)``; on the first mask's device."""
    device = masks[0].device if masks else torch.device("cpu")
    sizes = []
    for i, m in enumerate(masks):
        if m.dim() != 2 or m.shape[0] != m.shape[1] or m.dtype != torch.bool:
            raise ValueError(f"masks[{i}] must be a square bool matrix, got {m.dtype} {tuple(m.shape)}")
        sizes.append(m.numel())
    mask_start_loc = torch.zeros(len(masks) + 1, dtype=torch.int64)
    mask_start_loc[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    if masks:
        mask = torch.cat([m.reshape(-1).to(device) for m in masks])
    else:
        mask = torch.zeros(0, dtype=torch.bool, device=device)
    return mask, mask_start_loc.to(device)
