"""Split-KV ("flash-decoding": Dao, Haziza, Massa, Sizov 2023) for the paged attention kernel: how many programs
share one (query tile, KV head)'s cached context, and the kernel that merges their partial softmax states.

The split itself (each program walks a contiguous share of the context's key tiles and stores its unnormalized
output, running max and sum) is in ``_paged_attention_kernel`` (``NUM_SPLITS``); see :mod:`flexspec_kernels.attention`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._dispatch import EnvSettingError

# Split-KV for grids too small to fill the GPU (decode at small batch): "auto" (default), "0" (off) or a power of
# two. H200, session 19 (``bench/results/h200-2026-12-03-s19/split-kv/``): one attention launch at batch 1,
# context 128 / 2048: 5.9 / 39.2 us unsplit, 5.3 / 7.8 us with 16 splits; engine decode step at batch 1 0.71 ms
# at every context against 0.82 -> 1.37 ms unsplit as outputs grew by 1,000 tokens.
MAX_SPLITS = 16


def parse_split_kv(value: str) -> str:
    """A ``FLEXSPEC_SPLIT_KV`` value, normalized: "auto", "0" (off) or a power of two up to ``MAX_SPLITS``.
    Raises EnvSettingError (a ValueError) naming the variable otherwise."""
    v = value.strip().lower()
    if v == "auto" or (v.isdigit() and int(v) <= MAX_SPLITS and int(v) & (int(v) - 1) == 0):
        return str(int(v)) if v != "auto" else v
    raise EnvSettingError(
        f"FLEXSPEC_SPLIT_KV={value!r}: expected 'auto', 0 (off) or a power of two <= {MAX_SPLITS}"
    )


class SplitKVPartials(NamedTuple):
    """Split-KV attention's unmerged result (``paged_attention_triton(..., merge=False)``): partial outputs
    ``part_out`` [T, Hq, P, D] fp32 (unnormalized) and running max / sum ``part_ml`` [T, Hq, P, 2] fp32 (log2
    domain) of P splits, for a consumer that merges them itself (``flexspec_kernels.skinny_attention``)."""

    part_out: torch.Tensor
    part_ml: torch.Tensor


# ``FLEXSPEC_SPLIT_KV``, parsed at first use (``split_kv_setting``) so that importing the kernels never raises
# (front ends import EnvSettingError from here to report a bad value); benchmarks and tests assign it directly.
SPLIT_KV: str | None = None


def split_kv_setting() -> str:
    """The split-KV setting ("auto", "0" or a power of two): ``SPLIT_KV`` once set, else ``FLEXSPEC_SPLIT_KV``
    (default "auto"), read and checked on the first call. Raises EnvSettingError naming the variable."""
    global SPLIT_KV
    if SPLIT_KV is None:
        SPLIT_KV = parse_split_kv(os.environ.get("FLEXSPEC_SPLIT_KV", "auto"))
    return SPLIT_KV


# Engine decode steps on the H200 (session 19, ms per step over 3 rounds of 200 steps, 10 -> 610 output tokens):
# b=64 1 split 1.23 / 1.40 / 1.58, 2 splits 1.23 / 1.34 / 1.47; b=32 2 splits 1.12 / 1.21 / 1.29, 4 splits
# 1.11 / 1.16 / 1.21; b=16 4 and 8 splits within 1%; b=8 8 splits 0.97 / 1.01 / 1.03, unsplit 1.10 / 1.24 / 1.38.
# At 2 programs per SM (the first rule) b=64 stayed unsplit and b=32 took 2.
PROGRAMS_PER_SM = 4
_SM_COUNT: dict[int, int] = {}


def num_splits_for(num_programs: int, max_query_len: int, device: torch.device) -> int:
    """How many programs share each (query tile, KV head)'s context (split-KV, "flash-decoding": Dao, Haziza,
    Massa, Sizov 2023). Without it a decode step at batch 1 runs ``Hkv`` programs (3 for the default model) that
    each walk the whole context (an H200 decode step grew from 0.82 to 1.37 ms over 1,000 more tokens of
    context; 0.71 ms flat with splits, see ``SPLIT_KV``).
    Chosen from shapes only (CUDA graphs) with ``FLEXSPEC_SPLIT_KV=auto`` (the default): doubled while the grid
    stays within ``PROGRAMS_PER_SM`` programs per SM, up to ``MAX_SPLITS``, for queries of at most 16 tokens
    (decode, verification); 1 elsewhere and on CPU. For the default model's decode steps on the H200 (132 SMs; the
    grid counts ``T // BLOCK_Q + S`` query tiles x 3 KV heads): 16 splits at batch 1-8, 8 at 16, 4 at 32, 2 at 64.
    ``0`` turns it off; a number forces that many splits."""
    setting = split_kv_setting()
    if setting != "auto":
        return max(1, int(setting))
    if device.type != "cuda" or max_query_len > 16:
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    target = PROGRAMS_PER_SM * _SM_COUNT[idx]
    splits = 1
    while splits < MAX_SPLITS and num_programs * splits * 2 <= target:
        splits *= 2
    return splits


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] fp32
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32
    num_q_heads,
    o_stride_t,
    o_stride_h,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Split-KV reduction (flash-decoding, Dao et al. 2023): ``out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M)
    l_p`` with ``M = max_p m_p``, one program per (token, query head); zeros where no split saw a key."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (tok * num_q_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + offs_p) * 2)  # [NUM_SPLITS] (log2 domain; -inf: no key)
    l = tl.load(part_ml_ptr + (base + offs_p) * 2 + 1)  # [NUM_SPLITS]
    acc = tl.load(part_out_ptr + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :])  # [NUM_SPLITS, D]
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)  # [NUM_SPLITS]; 0 for splits without keys
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(out_ptr + tok * o_stride_t + head * o_stride_h + offs_d, out.to(out_ptr.dtype.element_ty))


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_ml: torch.Tensor) -> None:
    """Write ``out`` [T, Hq, D] from the splits' partial outputs ``part_out`` [T, Hq, P, D] fp32 and their running
    max / sum ``part_ml`` [T, Hq, P, 2] fp32 (log2 domain), P a power of two."""
    num_tokens, num_q_heads, num_splits, head_dim = part_out.shape
    _merge_splits_kernel[(num_tokens, num_q_heads)](
        out, part_out, part_ml, num_q_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=1 if head_dim <= 64 else 2,
    )  # fmt: skip
