"""FlexDraft parallel-mode input expansion: mask-token groups as pseudo-sequences.

FlexDraft (arXiv 2605.20022) drafts in *parallel mode* inside the target's verification forward: a
sequence ``s`` whose last committed token sits at position ``last_pos[s]`` carries
``num_groups[s]`` groups of ``B`` mask tokens (``B`` = the drafter's block size). Group ``k`` assumes
``k`` drafts get accepted, so it

* reads the first ``last_pos[s] + k + 1`` tokens of ``s``'s paged KV cache (context, then candidates
  ``0..k-1``) through ``s``'s block table, and
* puts its ``B`` mask tokens at positions ``last_pos[s] + k + 1 + j`` (``j = 0..B-1``), clamped to
  ``max_position``; they attend to each other bidirectionally and are never written to the cache.

Groups are laid out sequence by sequence, ``k`` ascending; ``G = sum(num_groups)`` is passed in as a
Python int, so neither backend needs a host sync. The result is the attention metadata of ``G``
pseudo-sequences of ``B`` tokens each (see :func:`flexspec_kernels.paged_attention`), as built per step by
``flexspec/spec/flexdraft.py``'s ``_side_stream``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton


class MaskGroups(NamedTuple):
    """Output of :func:`expand_mask_groups` (``G`` groups of ``B`` mask tokens)."""

    positions: torch.Tensor  # [G * B] int64, clamped to max_position
    context_lens: torch.Tensor  # [G] int32, last_pos[s] + k + 1
    block_tables: torch.Tensor  # [G, W] int32, the owning sequence's row
    query_start_loc: torch.Tensor  # [G + 1] int32, arange * B
    mask_start_loc: torch.Tensor  # [G + 1] int64, arange * B * B
    slot_mapping: torch.Tensor  # [G * B] int64, all -1 (mask tokens are never cached)
    mask: torch.Tensor  # [G * B * B] bool, all True (bidirectional within each group)
    group_seq: torch.Tensor  # [G] int32, owning sequence index


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------


@triton.jit
def _expand_mask_groups_kernel(
    positions_ptr,  # [G * B] int64 out
    context_lens_ptr,  # [G] int32 out
    group_block_tables_ptr,  # [G, W] int32 out (contiguous)
    group_seq_ptr,  # [G] int32 out
    last_pos_ptr,  # [S] int64
    num_groups_ptr,  # [S] int32
    cu_num_groups_ptr,  # [S] int64, inclusive cumulative sum of num_groups
    block_tables_ptr,  # [S, W] int32, last dim contiguous
    block_tables_stride_s,
    num_seqs,
    width,
    max_position,
    BLOCK_SIZE: tl.constexpr,  # B
    BLOCK_B: tl.constexpr,  # next power of two >= B
    BLOCK_W: tl.constexpr,  # block-table columns copied per iteration
    SEARCH_STEPS: tl.constexpr,  # S.bit_length(): enough halvings to search S entries
):
    """One program per group: binary-search its sequence, then write its metadata."""
    group = tl.program_id(0).to(tl.int64)

    # First s with cu_num_groups[s] > group (sequences with no groups are skipped automatically).
    lo = tl.full([], 0, tl.int64)
    hi = tl.full([], 0, tl.int64) + num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        cu = tl.load(cu_num_groups_ptr + mid, mask=active, other=0)
        go_left = active & (cu > group)
        hi = tl.where(go_left, mid, hi)
        lo = tl.where(active & (cu <= group), mid + 1, lo)
    seq = tl.minimum(lo, num_seqs - 1)  # only out of range if G != sum(num_groups) (unchecked)

    first_group = tl.load(cu_num_groups_ptr + seq) - tl.load(num_groups_ptr + seq)
    k = group - first_group  # drafts this group assumes accepted
    context_len = tl.load(last_pos_ptr + seq) + k + 1  # int64
    tl.store(context_lens_ptr + group, context_len.to(tl.int32))
    tl.store(group_seq_ptr + group, seq.to(tl.int32))

    offs_b = tl.arange(0, BLOCK_B)
    positions = tl.minimum(context_len + offs_b, max_position)
    tl.store(positions_ptr + group * BLOCK_SIZE + offs_b, positions, mask=offs_b < BLOCK_SIZE)

    src_row = block_tables_ptr + seq * block_tables_stride_s
    dst_row = group_block_tables_ptr + group * width
    for w_start in range(0, width, BLOCK_W):
        cols = w_start + tl.arange(0, BLOCK_W)
        valid = cols < width
        tl.store(dst_row + cols, tl.load(src_row + cols, mask=valid), mask=valid)


def expand_mask_groups_triton(
    last_pos: torch.Tensor,  # [S] int64
    num_groups: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, W] int32
    block_size: int,
    num_total_groups: int,
    max_position: int,
) -> MaskGroups:
    """Triton launcher of :func:`expand_mask_groups`. No host sync: ``num_total_groups`` must equal
    ``num_groups.sum()`` and is not checked against it."""
    _check_args(last_pos, num_groups, block_tables, block_size, num_total_groups, max_position)
    num_seqs, width = block_tables.shape
    device = last_pos.device
    G, B = num_total_groups, block_size

    positions = torch.empty(G * B, dtype=torch.int64, device=device)  # [G * B]
    context_lens = torch.empty(G, dtype=torch.int32, device=device)  # [G]
    group_block_tables = torch.empty(G, width, dtype=torch.int32, device=device)  # [G, W]
    group_seq = torch.empty(G, dtype=torch.int32, device=device)  # [G]
    if G > 0:
        cu_num_groups = torch.cumsum(num_groups, 0, dtype=torch.int64)  # [S] inclusive
        _expand_mask_groups_kernel[(G,)](
            positions, context_lens, group_block_tables, group_seq,
            last_pos, num_groups, cu_num_groups, block_tables, block_tables.stride(0),
            num_seqs, width, max_position,
            BLOCK_SIZE=B,
            BLOCK_B=triton.next_power_of_2(B),
            BLOCK_W=min(triton.next_power_of_2(max(width, 1)), 1024),
            SEARCH_STEPS=num_seqs.bit_length(),
        )  # fmt: skip
    return MaskGroups(
        positions, context_lens, group_block_tables, *_constant_outputs(G, B, device), group_seq
    )


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def expand_mask_groups_ref(
    last_pos: torch.Tensor,  # [S] int64
    num_groups: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, W] int32
    block_size: int,
    num_total_groups: int,
    max_position: int,
) -> MaskGroups:
    """Plain-torch reference (and CPU path) of :func:`expand_mask_groups`. Sync-free; on CPU a
    ``num_total_groups`` that differs from ``num_groups.sum()`` raises in ``repeat_interleave``."""
    _check_args(last_pos, num_groups, block_tables, block_size, num_total_groups, max_position)
    num_seqs = block_tables.shape[0]
    device = last_pos.device
    G, B = num_total_groups, block_size

    seq_ids = torch.arange(num_seqs, device=device)  # [S]
    group_seq = torch.repeat_interleave(seq_ids, num_groups, output_size=G)  # [G] int64
    first_group = torch.cumsum(num_groups, 0, dtype=torch.int64) - num_groups  # [S] exclusive
    k = torch.arange(G, device=device) - first_group[group_seq]  # [G]
    context_lens = last_pos[group_seq] + k + 1  # [G] int64
    offs = torch.arange(B, device=device)  # [B]
    positions = (context_lens[:, None] + offs).clamp(max=max_position).reshape(-1)  # [G * B]
    return MaskGroups(
        positions,
        context_lens.to(torch.int32),
        block_tables[group_seq].contiguous(),  # [G, W]
        *_constant_outputs(G, B, device),
        group_seq.to(torch.int32),
    )


# ---------------------------------------------------------------------------------------------
# Dispatcher and helpers
# ---------------------------------------------------------------------------------------------


def expand_mask_groups(
    last_pos: torch.Tensor,  # [S] int64
    num_groups: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, W] int32
    block_size: int,
    num_total_groups: int,
    max_position: int,
    backend: Backend = "auto",
) -> MaskGroups:
    """Build the attention metadata of FlexDraft's parallel-mode mask groups (module docstring).

    Args:
        last_pos: position of each sequence's last committed token.
        num_groups: groups per sequence (``>= 0``; usually drafts + 1, 0 for sequences not drafting).
        block_tables: each sequence's paged-KV block table (padded rows).
        block_size: ``B``, mask tokens per group (the drafter's block size, not the KV block size).
        num_total_groups: ``G = num_groups.sum()``, given by the caller so no host sync is needed.
        max_position: largest valid position (``max_position_embeddings - 1``); positions clamp to it.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        :class:`MaskGroups`: ``positions [G*B]``, ``context_lens [G]``, ``block_tables [G, W]``,
        ``query_start_loc [G+1]``, ``mask_start_loc [G+1]``, ``slot_mapping [G*B]`` (all -1),
        ``mask [G*B*B]`` (all True) and ``group_seq [G]``.
    """
    fn = expand_mask_groups_triton if use_triton(backend, last_pos) else expand_mask_groups_ref
    return fn(last_pos, num_groups, block_tables, block_size, num_total_groups, max_position)


def _constant_outputs(
    num_total_groups: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``query_start_loc, mask_start_loc, slot_mapping, mask``: they depend only on ``G`` and ``B``."""
    G, B = num_total_groups, block_size
    query_start_loc = torch.arange(0, (G + 1) * B, B, dtype=torch.int32, device=device)  # [G + 1]
    mask_start_loc = torch.arange(0, (G + 1) * B * B, B * B, dtype=torch.int64, device=device)  # [G + 1]
    slot_mapping = torch.full((G * B,), -1, dtype=torch.int64, device=device)  # [G * B]
    mask = torch.ones(G * B * B, dtype=torch.bool, device=device)  # [G * B * B]
    return query_start_loc, mask_start_loc, slot_mapping, mask


def _check_args(
    last_pos: torch.Tensor,
    num_groups: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_total_groups: int,
    max_position: int,
) -> None:
    """Shape / dtype / layout checks shared by both backends (no tensor values are read)."""
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [S, W], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    for name, t, dtype in (("last_pos", last_pos, torch.int64), ("num_groups", num_groups, torch.int32)):
        if tuple(t.shape) != (num_seqs,) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape ({num_seqs},), "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_total_groups < 0 or (num_seqs == 0 and num_total_groups > 0):
        raise ValueError(f"num_total_groups must be >= 0 (and 0 when S = 0), got {num_total_groups}")
    if max_position < 0:
        raise ValueError(f"max_position must be >= 0, got {max_position}")
    devices = {t.device for t in (last_pos, num_groups, block_tables)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
