"""Draft trees on the device: construction from a block drafter's per-depth candidates (``tree_top_paths``) and
greedy verification (``accept_tree_drafts``), each in one Triton launch with a plain-torch reference.

A DFlash block proposes, at each of its D depths, R candidate tokens with their probabilities; the candidates of
one depth do not depend on the path above them. The tree of N nodes with the highest path probability products
(EAGLE-2's dynamic tree, arXiv 2406.16858; ``flexspec.spec.tree.top_paths`` on the host) is then a beam over the
depths: the best N nodes of depth d are among the R children of the best N of depth d - 1; one final sort of all
beams orders the nodes best first, which is a topological order (a child's product is at most its parent's;
ties go to the shallower node).

``tree_top_paths_ref`` does this with torch ops (a top-k and a few index ops per depth: ~100 launches for 15
depths, ~0.35 ms of a batch-1 step on an H100 in session 35's profile); ``tree_top_paths_triton`` runs one
program per sequence: per depth, the W x R candidate sums are packed into int64 sort keys (the fp32 score's
order-preserving bits, then the candidate index) and sorted with ``tl.sort``; the beams live in a small scratch
buffer. Scores are fp32 log-probabilities there (fp64 in the reference): near-ties may order differently.

``accept_tree_drafts``: a node is accepted when its token equals the target's token at its parent's row and so
is every ancestor's; siblings hold distinct tokens, so the accepted nodes form one path (SpecInfer's tree
verification, arXiv 2305.09781, greedy). Both versions propagate along parent pointers by pointer jumping
(log2(K) + 1 rounds); the kernel, one program per sequence, gathers through [K, K] one-hot comparisons in
registers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._dispatch import Backend, use_triton


def tree_top_paths_ref(
    top: torch.Tensor, budget: int, threshold: float = 0.0, max_depth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`tree_top_paths` (same arguments and result, scores in fp64; one small
    op per depth: ~100 launches for 15 depths). Equal to ``paths_to_tree(top_paths(probs[:max_depth], ...))``
    (``flexspec.spec.tree``) when the products are distinct."""
    S, D, R2 = top.shape
    R = R2 // 2
    logp = top[..., :R].log()  # [S, D, R]
    if max_depth is not None:  # nodes too deep score -inf: never above a node that fits
        allowed = torch.arange(D, device=top.device)[None, :] < max_depth[:, None]  # [S, D]
        logp = logp.masked_fill(~allowed[..., None], -math.inf)
    ids = top[..., R:].long()
    depth_limit = min(D, budget)  # a path of N nodes is at most N deep
    scores, parents, ranks = [], [], []  # per depth: the beam's [S, W_d]
    beam = logp[:, 0, : min(budget, R)]
    scores.append(beam)
    parents.append(torch.full_like(beam, -1, dtype=torch.int64))
    ranks.append(torch.arange(beam.shape[1], device=top.device).expand(S, -1))
    for d in range(1, depth_limit):
        cand = (beam[:, :, None] + logp[:, d, None, :]).reshape(S, -1)  # [S, W * R]
        beam, idx = cand.topk(min(budget, cand.shape[1]), dim=1)  # sorted, highest first
        scores.append(beam)
        parents.append(idx // R)  # index in the previous depth's beam
        ranks.append(idx % R)
    widths = [s.shape[1] for s in scores]
    offsets = [0]  # first global index of each depth
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    all_scores = torch.cat(scores, 1)  # [S, M] depth-major: a stable sort puts a parent before an equal child
    M = all_scores.shape[1]
    n = min(budget, M)
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :n]  # [S, n]
    dev = top.device  # per global index: its depth, and the first global index of the depth above (no copies
    # from the host: this runs inside CUDA graph capture)
    depth_of = torch.cat([torch.full((w,), d, dtype=torch.int64, device=dev) for d, w in enumerate(widths)])
    above = torch.cat([torch.full((w,), offsets[max(d - 1, 0)], device=dev) for d, w in enumerate(widths)])
    parent_global = torch.cat(parents, 1) + above  # [S, M] (-1 at depth 0)
    parent_global = parent_global.clamp(min=0)
    token_of = torch.cat([ids[:, d].gather(1, r) for d, r in enumerate(ranks)], 1)  # [S, M]
    position = torch.full((S, M), n, dtype=torch.int64, device=top.device)  # global index -> tree index
    position.scatter_(1, order, torch.arange(n, device=top.device).expand(S, -1))
    sel_depth = depth_of[order]  # [S, n]
    sel_parent = position.gather(1, parent_global.gather(1, order))
    tree_parents = torch.where(sel_depth == 0, -1, sel_parent)
    drafts = token_of.gather(1, order)
    sel_scores = all_scores.gather(1, order)
    count = (sel_scores > -math.inf).sum(1)  # [S] nodes that fit max_depth
    if threshold > 0.0:
        passing = (sel_scores >= math.log(threshold)).sum(1)
        count = torch.minimum(passing.clamp(min=1), count)
    if n < budget:  # fewer candidate nodes than the budget: pad
        pad = budget - n
        drafts = torch.cat([drafts, drafts.new_zeros(S, pad)], 1)
        tree_parents = torch.cat([tree_parents, tree_parents.new_full((S, pad), -1)], 1)
    return drafts, tree_parents, count


@triton.jit
def _ordered(x):
    """fp32 -> int32 whose signed order is the floats' order."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    bits = tl.where(o >= 0, o, o ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pack(score, index, LAST: tl.constexpr):
    """Sort key: higher score first, then lower ``index`` (< LAST + 1 <= 2**31) first, under a descending sort."""
    return (_ordered(score).to(tl.int64) << 32) | (LAST - index).to(tl.int64)


@triton.jit
def _tree_top_paths_kernel(
    top_ptr, depth_ptr, drafts_ptr, parents_ptr, count_ptr,
    keys_ptr, score_ptr, parent_ptr, rank_ptr, pos_ptr,
    D, R, N, log_threshold,
    HAS_DEPTH: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    NP: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    top = top_ptr + s * D * 2 * R
    keys = keys_ptr + s * KEYS
    beam_score = score_ptr + s * DP * NP  # [DP, NP] per depth: the beam's scores, parents (beam index), ranks
    beam_parent = parent_ptr + s * DP * NP
    beam_rank = rank_ptr + s * DP * NP
    pos = pos_ptr + s * DP * NP  # global beam index -> tree index
    max_depth = D
    if HAS_DEPTH:
        max_depth = tl.minimum(tl.load(depth_ptr + s).to(tl.int32), D)
    j = tl.arange(0, NP)
    r = tl.arange(0, RP)
    # depth 0: the first min(N, R) candidates (sorted already)
    p = tl.load(top + j, mask=(j < R) & (j < N), other=1.0).to(tl.float32)
    beam = tl.where((j < R) & (j < N) & (max_depth > 0), tl.log(p), float("-inf"))
    tl.store(beam_score + j, beam)
    tl.store(beam_parent + j, tl.full([NP], -1, tl.int32))
    tl.store(beam_rank + j, j)
    for d in range(1, D):
        q = tl.load(top + d * 2 * R + r, mask=r < R, other=1.0).to(tl.float32)
        logq = tl.where((r < R) & (d < max_depth), tl.log(q), float("-inf"))
        cand = tl.reshape(beam[:, None] + logq[None, :], [NP * RP])  # index b * RP + r
        idx = tl.arange(0, NP * RP)
        ranked = tl.sort(_pack(cand, idx, NP * RP - 1), descending=True)
        tl.store(keys + idx, ranked)
        tl.debug_barrier()
        k = tl.load(keys + j)  # the NP best
        tl.debug_barrier()  # read before the next depth overwrites them
        pick = (NP * RP - 1) - (k & 0xFFFFFFFF).to(tl.int32)
        beam = tl.where(j < N, _unordered((k >> 32).to(tl.int32)), float("-inf"))
        tl.store(beam_score + d * NP + j, beam)
        tl.store(beam_parent + d * NP + j, pick // RP)
        tl.store(beam_rank + d * NP + j, pick % RP)
    tl.debug_barrier()
    # all depths' beams, best first (ties: depth-major, then beam order)
    g = tl.arange(0, DP * NP)
    scores = tl.load(beam_score + g, mask=g < D * NP, other=float("-inf"))
    ranked = tl.sort(_pack(scores, g, DP * NP - 1), descending=True)
    tl.store(keys + g, ranked)
    tl.debug_barrier()
    k = tl.load(keys + j)
    node = (DP * NP - 1) - (k & 0xFFFFFFFF).to(tl.int32)  # global beam index of tree node j
    score = _unordered((k >> 32).to(tl.int32))
    live = (j < N) & (score > float("-inf"))
    tl.store(pos + node, j, mask=live)
    tl.debug_barrier()
    depth = node // NP
    parent_beam = tl.load(beam_parent + node, mask=live, other=-1)
    above = tl.maximum((depth - 1) * NP + parent_beam, 0)
    parent = tl.where(depth > 0, tl.load(pos + above, mask=live & (depth > 0), other=-1), -1)
    rank = tl.load(beam_rank + node, mask=live, other=0)
    token = tl.load(top + depth * 2 * R + R + rank, mask=live, other=0.0).to(tl.int64)
    count = tl.sum(live.to(tl.int32), 0)
    if HAS_THRESHOLD:
        passing = tl.sum((live & (score >= log_threshold)).to(tl.int32), 0)
        count = tl.minimum(tl.maximum(passing, 1), count)
    out = j < N
    tl.store(drafts_ptr + s * N + j, tl.where(live, token, 0), mask=out)
    tl.store(parents_ptr + s * N + j, tl.where(live, parent, -1).to(tl.int64), mask=out)
    tl.store(count_ptr + s, count.to(tl.int64))


def tree_top_paths_triton(
    top: torch.Tensor, budget: int, threshold: float = 0.0, max_depth: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`tree_top_paths` (one program per sequence). ``budget`` <= 64, R <= 16,
    D <= 16 (ValueError otherwise)."""
    S, D, R2 = top.shape
    R = R2 // 2
    if not (1 <= budget <= 64 and 1 <= R <= 16 and 1 <= D <= 16) or R2 != 2 * R:
        raise ValueError(f"tree_top_paths_triton: budget {budget}, top {tuple(top.shape)} out of range")
    NP, RP, DP = triton.next_power_of_2(budget), triton.next_power_of_2(R), triton.next_power_of_2(D)
    dev = top.device
    drafts = torch.empty(S, budget, dtype=torch.int64, device=dev)
    parents = torch.empty(S, budget, dtype=torch.int64, device=dev)
    count = torch.empty(S, dtype=torch.int64, device=dev)
    if S == 0:
        return drafts, parents, count
    keys_width = max(NP * RP, DP * NP)
    keys = torch.empty(S, keys_width, dtype=torch.int64, device=dev)
    scores = torch.empty(S, DP * NP, dtype=torch.float32, device=dev)
    beam_parent = torch.empty(S, DP * NP, dtype=torch.int32, device=dev)
    beam_rank = torch.empty(S, DP * NP, dtype=torch.int32, device=dev)
    pos = torch.empty(S, DP * NP, dtype=torch.int32, device=dev)
    has_depth = max_depth is not None
    _tree_top_paths_kernel[(S,)](
        top.contiguous(), max_depth.contiguous() if has_depth else count, drafts, parents, count,
        keys, scores, beam_parent, beam_rank, pos,
        D, R, budget, math.log(threshold) if threshold > 0.0 else 0.0,
        HAS_DEPTH=has_depth, HAS_THRESHOLD=threshold > 0.0, NP=NP, RP=RP, DP=DP, KEYS=keys_width,
        num_warps=4,
    )  # fmt: skip
    return drafts, parents, count


def tree_top_paths(
    top: torch.Tensor,
    budget: int,
    threshold: float = 0.0,
    max_depth: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence, the ``budget`` rank paths of highest probability product, best first (parents before
    children), as a tree (see the module docstring).

    Args:
        top: [S, D, 2R] float, per depth the R candidates' probabilities (sorted, highest first) then their
            token ids (``DFlashDrafter._topk_block``).
        budget: N, nodes per tree (>= 1).
        threshold: keep only nodes whose probability product is >= this (always at least one node).
        max_depth: [S] int64, the deepest node allowed per sequence (None: D); <= 0 leaves no node.
        backend: "auto" (Triton for CUDA tensors within the kernel's sizes), "triton", "torch".

    Returns:
        drafts [S, N] int64 token ids, parents [S, N] int64 (-1: the root; ``parents[s, i] < i``), count [S] int64
        nodes kept (entries from ``count`` on are padding; nodes of probability 0 are never kept, where the host's
        ``top_paths`` fills its budget with them). Sync-free, fixed shapes (captured in CUDA graphs).
    """
    D, R2 = top.shape[1:]
    fits = budget <= 64 and R2 // 2 <= 16 and D <= 16
    if (backend == "auto" and top.is_cuda and fits) or (backend != "auto" and use_triton(backend, top)):
        return tree_top_paths_triton(top, budget, threshold, max_depth)
    return tree_top_paths_ref(top, budget, threshold, max_depth)


def accept_tree_drafts_ref(
    target_tokens: torch.Tensor,  # [N] int64: what plain decoding samples at each logits row
    starts: torch.Tensor,  # [S] int64: each sequence's root row (its query's first logits row)
    num_drafts: torch.Tensor,  # [S] int64: tree nodes verified per sequence (<= K)
    drafts: torch.Tensor,  # [S, K] int64: node tokens (columns past num_drafts ignored)
    parents: torch.Tensor,  # [S, K] int64: node parents (-1: root); a chain is [-1, 0, 1, ..]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`accept_tree_drafts` (pointer jumping: ~60 small launches at K = 15).

    Node i of sequence s sits at logits row ``starts[s] + 1 + i``. Returns tokens [S, K + 1] int64 (the target's
    token at the root row, then at the rows of the accepted path's nodes; the step emits ``tokens[s, :a + 1]``),
    accepted [S] int64 (a = the accepted path's length), path [S, K] int64 (the accepted node of depth k + 1 at
    column k for k < a; k itself beyond). For a chain this is ``accept_deterministic_drafts``."""
    S, K = drafts.shape
    dev = drafts.device
    col = torch.arange(K, device=dev)
    valid = col < num_drafts[:, None]  # [S, K]
    parent_rows = starts[:, None] + 1 + parents  # the root's row for parent -1
    match = (drafts == target_tokens[parent_rows]) & valid
    ok, depth, jump = match, torch.ones_like(parents), parents
    for _ in range(max(K, 1).bit_length()):  # ok: the node and all its ancestors matched
        has = jump >= 0
        j = jump.clamp(min=0)
        ok = ok & torch.where(has, ok.gather(1, j), True)
        depth = depth + torch.where(has, depth.gather(1, j), 0)
        jump = torch.where(has, jump.gather(1, j), -1)
    accepted = ok.sum(1)  # [S] one accepted node per depth
    path = torch.cat([col.expand(S, -1), col.new_zeros(S, 1)], 1)  # [S, K + 1], last column: discarded
    path.scatter_(1, torch.where(ok, depth - 1, K), col.expand(S, -1))
    path = path[:, :K]
    k = torch.arange(K + 1, device=dev)
    last = torch.minimum(k[None, :], accepted[:, None])  # rows past the path repeat its last one
    node = path.gather(1, (last - 1).clamp(min=0))
    rows = starts[:, None] + torch.where(last == 0, 0, 1 + node)
    return target_tokens[rows], accepted, path


@triton.jit
def _take(values, index, n: tl.constexpr):
    """values[index] for a register vector ``values`` [n] (0 where ``index`` is out of 0 .. n-1), by a one-hot
    [len(index), n] comparison."""
    cols = tl.arange(0, n)
    return tl.sum(tl.where(index[:, None] == cols[None, :], values[None, :], 0), axis=1)


@triton.jit
def _accept_tree_kernel(
    target_ptr, starts_ptr, num_drafts_ptr, drafts_ptr, parents_ptr, tokens_ptr, accepted_ptr, path_ptr,
    K, KP: tl.constexpr, KP1: tl.constexpr, ROUNDS: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + s)
    i = tl.arange(0, KP)
    in_k = i < K
    valid = i < tl.load(num_drafts_ptr + s)
    parent = tl.load(parents_ptr + s * K + i, mask=in_k, other=-1).to(tl.int32)
    draft = tl.load(drafts_ptr + s * K + i, mask=in_k, other=0)
    parent_token = tl.load(target_ptr + start + 1 + parent, mask=valid, other=-1)
    ok = (valid & (draft == parent_token)).to(tl.int32)
    depth = tl.full([KP], 1, tl.int32)
    jump = parent
    for _ in tl.static_range(ROUNDS):  # ok: the node and every ancestor matched; depth: 1 + ancestors
        has = jump >= 0
        ok = tl.where(has, ok * _take(ok, jump, KP), ok)
        depth = depth + tl.where(has, _take(depth, jump, KP), 0)
        jump = tl.where(has, _take(jump, jump, KP), -1)
    accepted = tl.sum(ok, 0)
    on_path = (ok[None, :] > 0) & (
        depth[None, :] - 1 == i[:, None]
    )  # [k, node]: the accepted node of depth k+1
    found = tl.sum(on_path.to(tl.int32), axis=1)
    path = tl.where(found > 0, tl.sum(tl.where(on_path, i[None, :], 0), axis=1), i)
    tl.store(path_ptr + s * K + i, path.to(tl.int64), mask=in_k)
    k = tl.arange(0, KP1)
    last = tl.minimum(k, accepted)  # rows past the path repeat its last one
    node = _take(path, last - 1, KP)
    row = start + tl.where(last == 0, 0, 1 + node)
    tl.store(tokens_ptr + s * (K + 1) + k, tl.load(target_ptr + row, mask=k <= K, other=0), mask=k <= K)
    tl.store(accepted_ptr + s, accepted.to(tl.int64))


def accept_tree_drafts_triton(
    target_tokens: torch.Tensor,
    starts: torch.Tensor,
    num_drafts: torch.Tensor,
    drafts: torch.Tensor,
    parents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`accept_tree_drafts` (one program per sequence; K <= 64, else ValueError)."""
    S, K = drafts.shape
    if K > 64:
        raise ValueError(f"accept_tree_drafts_triton: {K} nodes per tree (64 at most)")
    dev = drafts.device
    tokens = torch.empty(S, K + 1, dtype=torch.int64, device=dev)
    accepted = torch.empty(S, dtype=torch.int64, device=dev)
    path = torch.empty(S, K, dtype=torch.int64, device=dev)
    if S == 0:
        return tokens, accepted, path
    KP = triton.next_power_of_2(max(K, 1))
    _accept_tree_kernel[(S,)](  # unit strides assumed (the fused tail passes columns of its staged rows)
        target_tokens.contiguous(), starts.contiguous(), num_drafts.contiguous(), drafts.contiguous(),
        parents.contiguous(), tokens, accepted, path,
        K, KP=KP, KP1=triton.next_power_of_2(K + 1), ROUNDS=KP.bit_length(), num_warps=4,
    )  # fmt: skip
    return tokens, accepted, path


def accept_tree_drafts(
    target_tokens: torch.Tensor,  # [N] int64: what plain decoding samples at each logits row
    starts: torch.Tensor,  # [S] int64: each sequence's root row (its query's first logits row)
    num_drafts: torch.Tensor,  # [S] int64: tree nodes verified per sequence (<= K)
    drafts: torch.Tensor,  # [S, K] int64: node tokens (columns past num_drafts ignored)
    parents: torch.Tensor,  # [S, K] int64: node parents (-1: root); a chain is [-1, 0, 1, ..]
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of draft trees on the device, without a host sync (``flexspec.spec.tree.walk``).

    Node i of sequence s sits at logits row ``starts[s] + 1 + i``; parents must be a tree in topological order
    (``parents[s, i] < i``) over the first ``num_drafts[s]`` nodes. Returns tokens [S, K + 1] int64 (the target's
    token at the root row, then at the rows of the accepted path's nodes; the step emits ``tokens[s, :a + 1]``),
    accepted [S] int64 (a = the accepted path's length), path [S, K] int64 (the accepted node of depth k + 1 at
    column k for k < a; k itself beyond). For a chain this is ``accept_deterministic_drafts``
    (``flexspec.spec.verifier``). ``backend``: "auto" (Triton for CUDA tensors, K <= 64), "triton", "torch".
    """
    K = drafts.shape[1]
    if (backend == "auto" and drafts.is_cuda and K <= 64) or (
        backend != "auto" and use_triton(backend, drafts)
    ):
        return accept_tree_drafts_triton(target_tokens, starts, num_drafts, drafts, parents)
    return accept_tree_drafts_ref(target_tokens, starts, num_drafts, drafts, parents)
