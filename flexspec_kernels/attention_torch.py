"""Plain-torch paths of ``flexspec_kernels.attention.paged_attention``: the per-sequence reference, the vectorized
CPU path, and the argument checks both backends share.

Vectorized torch path of ``paged_attention`` for CPUs (one batched SDPA call per layer).

``paged_attention_ref`` loops over sequences and is the readable reference; this path pads every sequence
to the batch's longest context + new tokens, builds one boolean visibility mask [S, 1, n_max, L_max] and
calls ``scaled_dot_product_attention`` once, which is several times faster on CPU for decode batches.
Semantics are identical (tested against the reference).

When the caller says where this step's K/V were written (``slot_mapping``, as the engine's layers do before
attending) and every new token sits at its sequence's next position, keys and values are read in one
``index_select`` per tensor over context + new tokens ("merged" plan): no masking copy of the gathered context,
no concatenation, and with the same number of new tokens per sequence (decode, uniform verification) no
padding of queries either. Padded key slots point at the sequence's own position 0, a written entry, so
nothing outside the sequence's context and new tokens is read.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _step_plan(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    mask_start_loc: torch.Tensor | None,
    sliding_window: int | None,
    block_size: int,
    num_tokens: int,
    step_cache: dict | None,
    slot_mapping: torch.Tensor | None = None,
) -> dict | None:
    """What ``paged_attention_torch`` derives from a step's metadata (gather indices, the visibility mask): the
    same for every layer, so it is kept in ``step_cache`` (a dict that lives for one step, e.g.
    ``AttentionMetadata.step_cache``). Entries hold the metadata tensors they were built from and match them by
    identity (a ``dataclasses.replace``d metadata with another mask shares the dict but not the entry)."""
    inputs = (block_tables, context_lens, query_start_loc, positions, mask, mask_start_loc, slot_mapping)
    entries = None
    if step_cache is not None:
        entries = step_cache.setdefault(("paged_attention_torch", sliding_window, block_size, num_tokens), [])
        for held, plan in entries:
            if all(a is b for a, b in zip(held, inputs)):
                return plan
    plan = None
    if slot_mapping is not None:
        plan = _merged_plan(*inputs, sliding_window, block_size, num_tokens)
    if plan is None:
        plan = _make_plan(*inputs[:-1], sliding_window, block_size, num_tokens)
    if entries is not None:
        entries.append((inputs, plan))
    return plan


def _merged_plan(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    mask_start_loc: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    sliding_window: int | None,
    bsz: int,
    T: int,
) -> dict | None:
    """The plan that reads this step's new K/V from the cache (see the module docstring), or None where it does
    not apply: a sequence without new tokens, a new token not cached at its sequence's next position (mask
    tokens with slot -1, drafting groups at shifted positions), or a sequence longer than its block table."""
    S = context_lens.shape[0]
    if S == 0 or T == 0 or slot_mapping.shape != (T,):
        return None
    qsl = query_start_loc.long()
    n = qsl[1:] - qsl[:-1]  # [S]
    if not bool((n > 0).all()):
        return None
    ctx = context_lens.long()
    dev = positions.device
    seq_len = ctx + n  # [S] keys per sequence: context + new tokens
    n_max, L = int(n.max()), int(seq_len.max())
    tables = block_tables.long()
    if L > tables.shape[1] * bsz:
        return None

    def slot_of(pos: torch.Tensor) -> torch.Tensor:  # [S, m] positions -> cache slots
        return tables.gather(1, (pos // bsz).clamp(max=tables.shape[1] - 1)) * bsz + pos % bsz

    i = torch.arange(n_max, device=dev)
    valid_q = i.unsqueeze(0) < n.unsqueeze(1)  # [S, n_max]
    rows = (qsl[:-1].unsqueeze(1) + i).clamp(max=T - 1)  # [S, n_max]
    next_pos = ctx.unsqueeze(1) + i  # [S, n_max]
    at_next = (positions[rows] == next_pos) & (slot_mapping[rows] == slot_of(next_pos))
    if not bool((at_next | ~valid_q).all()):
        return None
    j = torch.arange(L, device=dev)
    in_seq = j.unsqueeze(0) < seq_len.unsqueeze(1)  # [S, L]
    first = tables[:, :1] * bsz  # [S, 1] slot of position 0: written (context or this step's first token)
    slots = torch.where(in_seq, slot_of(j.expand(S, L)), first)
    rel = j.unsqueeze(0) - ctx.unsqueeze(1)  # [S, L] index among the new tokens (< 0: context)
    is_new = (rel >= 0) & in_seq
    if mask is None:
        new_vis = rel.unsqueeze(1) <= i.view(1, n_max, 1)  # causal by index
    else:
        assert mask_start_loc is not None
        ms = mask_start_loc.long()
        idx = ms[:-1].view(S, 1, 1) + i.view(1, n_max, 1) * n.view(S, 1, 1) + rel.clamp(min=0).unsqueeze(1)
        new_vis = mask[idx.clamp(0, max(mask.numel() - 1, 0))]  # [S, n_max, L]
    visible = (rel < 0).unsqueeze(1) | (is_new.unsqueeze(1) & new_vis)  # [S, n_max, L]
    if sliding_window is not None:
        visible = visible & (next_pos.unsqueeze(2) - j.view(1, 1, L) < sliding_window)
    any_vis = visible.any(-1, keepdim=True)  # [S, n_max, 1]
    uniform = bool((n == n_max).all()) and int(qsl[0]) == 0 and S * n_max == T  # queries need no padding
    plan: dict = {"merged": True, "slots": slots.view(-1), "L": L, "n_max": n_max, "uniform": uniform}
    plan["safe"] = None if bool(visible.all()) else (visible | ~any_vis).unsqueeze(1)  # [S, 1, n_max, L]
    plan["any_vis"] = None if bool((any_vis | ~valid_q.unsqueeze(2)).all()) else any_vis.unsqueeze(-1)
    if not uniform:
        plan["rows"], plan["valid_q"], plan["out_rows"] = rows, valid_q, rows[valid_q]
    return plan


def _make_plan(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    mask_start_loc: torch.Tensor | None,
    sliding_window: int | None,
    bsz: int,
    T: int,
) -> dict | None:
    """The step plan (see ``_step_plan``); None when no query has a key to attend to."""
    S = context_lens.shape[0]
    dev = positions.device
    qsl = query_start_loc.long()
    n = qsl[1:] - qsl[:-1]  # [S]
    ctx = context_lens.long()  # [S]
    n_max = int(n.max()) if S else 0
    c_max = int(ctx.max()) if S else 0
    if T == 0 or n_max == 0:
        return None
    plan: dict = {"c_max": c_max}
    # Cached context, gathered through the block tables: [S, c_max, Hkv, D].
    j = torch.arange(c_max, device=dev)
    if c_max:
        in_ctx = j.unsqueeze(0) < ctx.unsqueeze(1)  # [S, c_max]; entries past a context are never read
        blocks = block_tables.long()[:, (j // bsz).clamp(max=block_tables.shape[1] - 1)]  # [S, c_max]
        plan["slots"] = torch.where(in_ctx, blocks * bsz + j % bsz, 0)
        plan["keep"] = in_ctx.view(S, c_max, 1, 1)
    # New tokens padded per sequence: [S, n_max, ...].
    i = torch.arange(n_max, device=dev)
    valid_q = i.unsqueeze(0) < n.unsqueeze(1)  # [S, n_max]
    rows = (qsl[:-1].unsqueeze(1) + i).clamp(max=T - 1)  # [S, n_max]
    pos_new = positions[rows]  # [S, n_max]
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
    any_vis = visible.any(-1, keepdim=True)  # [S, n_max, 1]
    plan["safe"] = (visible | ~any_vis).unsqueeze(1)  # rows with no key attend to everything, then get zeroed
    plan["any_vis"] = any_vis.unsqueeze(-1)  # [S, n_max, 1, 1]
    plan["rows"], plan["valid_q"] = rows, valid_q
    plan["out_rows"] = rows[valid_q]
    return plan


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
    step_cache: dict | None = None,  # derived metadata shared by the step's layers (see _step_plan)
    slot_mapping: torch.Tensor | None = None,  # [T] int64: k / v were written to the cache at these slots
) -> torch.Tensor:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    S = context_lens.shape[0]
    plan = _step_plan(
        block_tables, context_lens, query_start_loc, positions, mask, mask_start_loc, sliding_window,
        k_cache.shape[1], T, step_cache, slot_mapping,
    )  # fmt: skip
    if plan is None:
        return torch.zeros_like(q)
    if plan.get("merged"):  # context + new tokens from the cache, one gather each
        L, n_max = plan["L"], plan["n_max"]
        kh, vh = (  # [S, Hkv, L, D]
            c.reshape(-1, Hkv * D).index_select(0, plan["slots"]).view(S, L, Hkv, D).transpose(1, 2).float()
            for c in (k_cache, v_cache)
        )
        qs = q.view(S, n_max, Hq, D) if plan["uniform"] else q[plan["rows"]]
    else:
        c_max, rows = plan["c_max"], plan["rows"]
        if c_max:
            slots, keep = plan["slots"], plan["keep"]
            k_ctx = torch.where(keep, k_cache.reshape(-1, Hkv, D)[slots], 0)
            v_ctx = torch.where(keep, v_cache.reshape(-1, Hkv, D)[slots], 0)
        else:
            k_ctx = k.new_zeros(S, 0, Hkv, D)
            v_ctx = k_ctx
        kh = torch.cat([k_ctx, k[rows]], dim=1).transpose(1, 2).float()  # [S, Hkv, L, D]
        vh = torch.cat([v_ctx, v[rows]], dim=1).transpose(1, 2).float()
        qs = q[rows]
    qh = qs.transpose(1, 2).float()  # [S, Hq, n_max, D]
    safe = plan["safe"]  # [S, 1, n_max, L]; None: every key visible to every query
    if logits_soft_cap is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=safe, scale=scale, enable_gqa=Hq != Hkv)
    else:
        kh = kh.repeat_interleave(Hq // Hkv, dim=1)  # [S, Hq, L, D]
        vh = vh.repeat_interleave(Hq // Hkv, dim=1)
        s = torch.einsum("shqd,shkd->shqk", qh, kh) * scale
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        o = torch.softmax(s if safe is None else s.masked_fill(~safe, float("-inf")), -1) @ vh
    o = o.transpose(1, 2)  # [S, n_max, Hq, D]
    if plan["any_vis"] is not None:
        o = o * plan["any_vis"]  # queries with no visible key give zeros
    if plan.get("uniform"):
        return o.reshape(T, Hq, D).to(q.dtype)
    out = torch.zeros_like(q)
    out[plan["out_rows"]] = o[plan["valid_q"]].to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Reference (readable, one sequence at a time)
# ---------------------------------------------------------------------------------------------


def paged_attention_ref(
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
) -> torch.Tensor:  # [T, Hq, D]
    """Plain-torch reference (and CPU path) of :func:`paged_attention`: one sequence at a time.

    Reads sequence lengths on the host (``.tolist()``), so it syncs on GPU tensors.
    """
    _check_args(
        q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions,
        sliding_window, mask, mask_start_loc, logits_soft_cap,
    )  # fmt: skip
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    device = q.device

    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    mask_starts = mask_start_loc.tolist() if mask_start_loc is not None else None
    for s, ctx in enumerate(ctx_lens):
        start, end = starts[s], starts[s + 1]
        n = end - start
        if n == 0:
            continue
        blocks = block_tables[s, : -(-ctx // block_size)].long()
        k_ctx = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, Hkv, D]
        v_ctx = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, Hkv, D]
        keys = torch.cat([k_ctx, k[start:end]]).float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = torch.cat([v_ctx, v[start:end]]).float().repeat_interleave(group, dim=1)  # [L, Hq, D]

        q_pos = positions[start:end]  # [n]
        k_pos = torch.cat([torch.arange(ctx, device=device), q_pos])  # [L]
        if mask is None:
            new_visible = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
        else:
            assert mask_starts is not None
            new_visible = mask[mask_starts[s] : mask_starts[s] + n * n].view(n, n)  # [n, n]
        ctx_visible = torch.ones(n, ctx, dtype=torch.bool, device=device)  # [n, ctx]
        visible = torch.cat([ctx_visible, new_visible], dim=1)  # [n, L]
        if sliding_window is not None:
            visible = visible & (q_pos[:, None] - k_pos[None, :] < sliding_window)

        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale  # [Hq, n, L]
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)  # no key: zeros, not NaN
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    mask: torch.Tensor | None,
    mask_start_loc: torch.Tensor | None,
    logits_soft_cap: float | None,
) -> None:
    """Shape / dtype / layout checks shared by both backends (no tensor values are read)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"q must be [T, Hq, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "k_cache and v_cache must be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache [.., .., Hkv, D] = {tuple(k_cache.shape)} does not match k {tuple(k.shape)}")
    dtypes = {t.dtype for t in (q, k, v, k_cache, v_cache)}
    if len(dtypes) != 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v, k_cache, v_cache must share one float dtype, got {dtypes}")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [S, max_blocks], got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.shape[1] > 0 and block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    for name, t, shape, dtype in (
        ("context_lens", context_lens, (num_seqs,), torch.int32),
        ("query_start_loc", query_start_loc, (num_seqs + 1,), torch.int32),
        ("positions", positions, (num_tokens,), torch.int64),
    ):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}"
            )
    if (mask is None) != (mask_start_loc is None):
        raise ValueError("mask and mask_start_loc must be given together (see pack_masks)")
    if mask is not None and mask_start_loc is not None:
        if mask.dim() != 1 or mask.dtype != torch.bool or not mask.is_contiguous():
            raise ValueError(
                f"mask must be a packed contiguous 1-D bool tensor, got {mask.dtype} {tuple(mask.shape)}"
            )
        if tuple(mask_start_loc.shape) != (num_seqs + 1,) or mask_start_loc.dtype != torch.int64:
            raise ValueError(
                f"mask_start_loc must be int64 [S + 1 = {num_seqs + 1}], got "
                f"{mask_start_loc.dtype} {tuple(mask_start_loc.shape)}"
            )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if logits_soft_cap is not None and not (logits_soft_cap > 0 and math.isfinite(logits_soft_cap)):
        raise ValueError(f"logits_soft_cap must be a positive finite float or None, got {logits_soft_cap}")
    tensors = [q, k, v, k_cache, v_cache, block_tables, context_lens, query_start_loc, positions]
    tensors += [t for t in (mask, mask_start_loc) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
