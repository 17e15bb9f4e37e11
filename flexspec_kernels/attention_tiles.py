"""Device-side building blocks of the paged attention kernel (:mod:`flexspec_kernels.attention`): the
program's sequence lookup, the online-softmax update (FlashAttention-2, Dao, arXiv 2307.08691; log2 domain),
score scaling with the optional soft cap, and the passes over this step's new tokens as keys (custom mask,
causal, none). Triton functions only; the kernel and its launcher live in ``attention.py``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= q_block_idx`` (binary search)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _online_softmax_step(
    scores,  # [BLOCK_M, BLOCK_N] fp32, already scaled (log2 domain), -inf where masked
    v,  # [BLOCK_N, HEAD_DIM]
    m_i,  # [BLOCK_M] running max (log2 domain)
    l_i,  # [BLOCK_M] running sum of exp2
    acc,  # [BLOCK_M, HEAD_DIM] fp32
):
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # Rows that have seen no visible key keep m = -inf; subtract 0 there to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _scale_scores(qk, scale, soft_cap, USE_SOFT_CAP: tl.constexpr):
    """``qk * scale``, optionally ``cap * tanh(. / cap)``, converted to the log2 domain."""
    if USE_SOFT_CAP:
        s = qk * scale
        # tanh(x) = 1 - 2 / (exp(2x) + 1): portable (no libdevice), saturates cleanly at +-1.
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        return s * 1.4426950408889634
    return qk * (scale * 1.4426950408889634)


MASK_NONE: tl.constexpr = tl.constexpr(0)  # every key of the range visible (before the diagonal)
MASK_CAUSAL: tl.constexpr = tl.constexpr(1)  # key index <= query index
MASK_CUSTOM: tl.constexpr = tl.constexpr(2)  # packed per-sequence [n, n] bool mask


@triton.jit
def _attend_new_tokens(
    m_i,  # [BLOCK_M] fp32
    l_i,  # [BLOCK_M] fp32
    acc,  # [BLOCK_M, HEAD_DIM] fp32
    q,  # [BLOCK_M, HEAD_DIM]
    q_local,  # [BLOCK_M] query index within the sequence
    q_pos,  # [BLOCK_M] int64 query position
    row_valid,  # [BLOCK_M] bool
    kv_begin,  # first new-token index of the range (multiple of BLOCK_N)
    kv_end,  # one past the last new-token index of the range
    q_start,  # offset of the sequence's first new token in T
    q_len,  # n_s
    kv_head,
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int64
    mask_row_ptr,  # [BLOCK_M] pointers to each row's mask row (MASK_CUSTOM only)
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    scale,
    sliding_window,
    soft_cap,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_MODE: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Online-softmax pass over new tokens ``[kv_begin, kv_end)`` of one sequence."""
    offs_d = tl.arange(0, HEAD_DIM)
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        offs_n = kv_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] index in seq
        kv_valid = offs_n < q_len
        kv_tok = (q_start + offs_n).to(tl.int64)
        k = tl.load(
            k_ptr + kv_tok[None, :] * k_stride_t + kv_head * k_stride_h + offs_d[:, None],
            mask=kv_valid[None, :],
            other=0.0,
        )  # [HEAD_DIM, BLOCK_N]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        scores = _scale_scores(
            tl.dot(q, k, input_precision="ieee"), scale, soft_cap, USE_SOFT_CAP
        )  # [BLOCK_M, BLOCK_N]
        if MASK_MODE == MASK_CUSTOM:
            allowed = tl.load(
                mask_row_ptr[:, None] + offs_n[None, :],
                mask=row_valid[:, None] & kv_valid[None, :],
                other=0,
            )
            visible = allowed != 0
        elif MASK_MODE == MASK_CAUSAL:
            visible = (offs_n[None, :] <= q_local[:, None]) & kv_valid[None, :]
        else:
            visible = kv_valid[None, :]
        if USE_SLIDING_WINDOW:
            k_pos = tl.load(positions_ptr + kv_tok, mask=kv_valid, other=0)
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < sliding_window)
        if MASK_MODE != MASK_NONE or USE_SLIDING_WINDOW:
            scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(
            v_ptr + kv_tok[:, None] * v_stride_t + kv_head * v_stride_h + offs_d[None, :],
            mask=kv_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        if UPCAST_DOT:
            v = v.to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(scores, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _attend_step_tokens(
    m_i, l_i, acc, q, q_local, q_pos, row_valid, seq, q_start, q_len, q_block_local, kv_head,
    k_ptr, v_ptr, positions_ptr, mask_ptr, mask_start_loc_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, scale, sliding_window, soft_cap,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """This step's new tokens as keys (read from k / v), under the custom mask or causally."""
    if HAS_MASK:
        mask_row = mask_ptr + tl.load(mask_start_loc_ptr + seq) + q_local.to(tl.int64) * q_len
        m_i, l_i, acc = _attend_new_tokens(
            m_i, l_i, acc, q, q_local, q_pos, row_valid, 0, q_len, q_start, q_len, kv_head,
            k_ptr, v_ptr, positions_ptr, mask_row, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
            scale, sliding_window, soft_cap,
            HEAD_DIM, BLOCK_N, MASK_CUSTOM, USE_SLIDING_WINDOW, USE_SOFT_CAP, UPCAST_DOT,
        )  # fmt: skip
    else:
        # Causal: key tiles before the tile's first query are fully visible (no mask needed),
        # tiles after its last query are invisible; only the diagonal tiles are masked.
        diag_start = (q_block_local * BLOCK_Q) // BLOCK_N * BLOCK_N
        diag_end = tl.minimum(q_len, (q_block_local + 1) * BLOCK_Q)
        m_i, l_i, acc = _attend_new_tokens(
            m_i, l_i, acc, q, q_local, q_pos, row_valid, 0, diag_start, q_start, q_len, kv_head,
            k_ptr, v_ptr, positions_ptr, mask_ptr, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
            scale, sliding_window, soft_cap,
            HEAD_DIM, BLOCK_N, MASK_NONE, USE_SLIDING_WINDOW, USE_SOFT_CAP, UPCAST_DOT,
        )  # fmt: skip
        m_i, l_i, acc = _attend_new_tokens(
            m_i, l_i, acc, q, q_local, q_pos, row_valid, diag_start, diag_end, q_start, q_len,
            kv_head, k_ptr, v_ptr, positions_ptr, mask_ptr, k_stride_t, k_stride_h, v_stride_t,
            v_stride_h, scale, sliding_window, soft_cap,
            HEAD_DIM, BLOCK_N, MASK_CAUSAL, USE_SLIDING_WINDOW, USE_SOFT_CAP, UPCAST_DOT,
        )  # fmt: skip
    return m_i, l_i, acc
