"""Vectorized torch path of ``paged_attention`` for CPUs (one batched SDPA call per layer).

``paged_attention_ref`` loops over sequences and is the readable reference; this path pads every sequence
to the batch's longest context + new tokens, builds one boolean visibility mask [S, 1, n_max, L_max] and
calls ``scaled_dot_product_attention`` once, which is several times faster on CPU for decode batches.
Semantics are identical (tested against the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    context_lens: torch.Tensor,  # [S] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    positions: torch.Tensor,  # [T] int64
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,  # [sum n_s^2] bool
    mask_start_loc: torch.Tensor | None = None,  # [S + 1] int64
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    S = context_lens.shape[0]
    dev = q.device
    bsz = k_cache.shape[1]
    qsl = query_start_loc.long()
    n = qsl[1:] - qsl[:-1]  # [S]
    ctx = context_lens.long()  # [S]
    n_max = int(n.max()) if S else 0
    c_max = int(ctx.max()) if S else 0
    if T == 0 or n_max == 0:
        return torch.zeros_like(q)

    # Cached context, gathered through the block tables: [S, c_max, Hkv, D].
    j = torch.arange(c_max, device=dev)
    if c_max:
        in_ctx = j.unsqueeze(0) < ctx.unsqueeze(1)  # [S, c_max]; entries past a context are never read
        blocks = block_tables.long()[:, (j // bsz).clamp(max=block_tables.shape[1] - 1)]  # [S, c_max]
        slots = torch.where(in_ctx, blocks * bsz + j % bsz, 0)
        keep = in_ctx.view(S, c_max, 1, 1)
        k_ctx = torch.where(keep, k_cache.reshape(-1, Hkv, D)[slots], 0)
        v_ctx = torch.where(keep, v_cache.reshape(-1, Hkv, D)[slots], 0)
    else:
        k_ctx = k.new_zeros(S, 0, Hkv, D)
        v_ctx = k_ctx
    # New tokens padded per sequence: [S, n_max, ...].
    i = torch.arange(n_max, device=dev)
    valid_q = i.unsqueeze(0) < n.unsqueeze(1)  # [S, n_max]
    rows = (qsl[:-1].unsqueeze(1) + i).clamp(max=T - 1)  # [S, n_max]
    q_pad = q[rows]  # [S, n_max, Hq, D]
    k_new, v_new = k[rows], v[rows]
    pos_new = positions[rows]  # [S, n_max]

    keys = torch.cat([k_ctx, k_new], dim=1)  # [S, L, Hkv, D]
    values = torch.cat([v_ctx, v_new], dim=1)
    ctx_vis = (j.unsqueeze(0) < ctx.unsqueeze(1)).unsqueeze(1).expand(S, n_max, c_max)  # [S, n_max, c_max]
    if mask is None:
        new_vis = (i.unsqueeze(0) <= i.unsqueeze(1)).unsqueeze(0).expand(S, n_max, n_max).clone()
    else:
        assert mask_start_loc is not None
        ms = mask_start_loc.long()
        idx = ms[:-1].view(S, 1, 1) + i.view(1, n_max, 1) * n.view(S, 1, 1) + i.view(1, 1, n_max)
        inside = valid_q.unsqueeze(2) & valid_q.unsqueeze(1)
        new_vis = mask[idx.clamp(0, max(mask.numel() - 1, 0))] & inside
    new_vis &= valid_q.unsqueeze(1)  # padded keys invisible
    visible = torch.cat([ctx_vis, new_vis], dim=2)  # [S, n_max, L]
    if sliding_window is not None:
        k_pos = torch.cat([j.unsqueeze(0).expand(S, c_max), pos_new], dim=1)  # [S, L]
        visible = visible & (pos_new.unsqueeze(2) - k_pos.unsqueeze(1) < sliding_window)

    qh = q_pad.transpose(1, 2).float()  # [S, Hq, n_max, L]
    kh = keys.transpose(1, 2).float().repeat_interleave(Hq // Hkv, dim=1)  # [S, Hq, L, D]
    vh = values.transpose(1, 2).float().repeat_interleave(Hq // Hkv, dim=1)
    any_vis = visible.any(-1, keepdim=True)  # [S, n_max, 1]
    safe = visible | ~any_vis  # rows with no key attend to everything, then get zeroed
    if logits_soft_cap is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=safe.unsqueeze(1), scale=scale)
    else:
        s = torch.einsum("shqd,shkd->shqk", qh, kh) * scale
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        o = torch.softmax(s.masked_fill(~safe.unsqueeze(1), float("-inf")), -1) @ vh
    o = o.transpose(1, 2) * any_vis.unsqueeze(-1)  # [S, n_max, Hq, D]
    out = torch.zeros_like(q)
    out[rows[valid_q]] = o[valid_q].to(q.dtype)
    return out
