"""Draft trees on the device: building, verifying and settling a step's trees without a host sync.

The host versions (:mod:`flexspec.spec.tree`) walk Python lists; these do the same on fixed-shape tensors, so a
tree step can run as a chain step does (``SpecDecodeWorker``'s device-side path, captured in ``FusedVerifyGraphs``):
the target's verification forward, then acceptance, the K/V moves, the drafter's context and its next tree, and
one readback.

- ``flexspec_kernels.tree_topk.tree_top_paths`` (one Triton launch; its torch reference beside it) builds the
  trees: the N rank paths of highest probability product from a DFlash block's per-depth top-R candidates.
- ``accept_tree_drafts``: greedy tree verification (``flexspec.spec.tree.walk``): a node is accepted when its
  token equals the target's token at its parent's row and so is every ancestor's (pointer jumping: log2(depth)
  rounds); siblings hold distinct tokens, so the accepted nodes form one path.
- ``tree_move_pairs``: the KV slots that move so the cache holds the accepted path at its positions' slots
  (``flexspec.spec.tree.move_slots``), padded to a fixed count with copies of one real move.
"""

from __future__ import annotations

import torch

from flexspec.spec.tree import tree_rows


def accept_tree_drafts(
    target_tokens: torch.Tensor,  # [N] int64: what plain decoding samples at each logits row
    starts: torch.Tensor,  # [S] int64: each sequence's root row (its query's first logits row)
    num_drafts: torch.Tensor,  # [S] int64: tree nodes verified per sequence (<= K)
    drafts: torch.Tensor,  # [S, K] int64: node tokens (columns past num_drafts ignored)
    parents: torch.Tensor,  # [S, K] int64: node parents (-1: root); a chain is [-1, 0, 1, ..]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of draft trees on the device (``flexspec.spec.tree.walk``), without a host sync.

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


def tree_move_pairs(
    slots: torch.Tensor,  # [S, K + 1] int64: KV slot of each sequence's root row, then of node rows 0 .. K-1
    path: torch.Tensor,  # [S, K] int64 (``accept_tree_drafts``)
    accepted: torch.Tensor,  # [S] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV slots to copy after verifying trees: accepted node ``path[s, k]`` belongs at the slot of node row k
    (position root + 1 + k). Returns (src [S * K], dst [S * K]) int64: the real moves, and in every other entry a
    copy of one real move (or slot 0 onto itself when there is none), so a gather then a scatter of all of them
    writes only what the real moves write. Sync-free."""
    K = path.shape[1]
    k = torch.arange(K, device=path.device)
    real = ((k[None, :] < accepted[:, None]) & (path != k)).reshape(-1)
    node_slots = slots[:, 1:]
    src = node_slots.gather(1, path).reshape(-1)
    dst = node_slots.reshape(-1)
    g = real.to(torch.int32).argmax().view(1)  # a real move if there is any (argmax: the first maximum)
    any_real = real.index_select(0, g)  # [1] (indexing with a 0-d tensor would read it on the host)
    src_g = torch.where(any_real, src.index_select(0, g), 0)
    dst_g = torch.where(any_real, dst.index_select(0, g), 0)
    return torch.where(real, src, src_g), torch.where(real, dst, dst_g)


def settle_trees_on_device(
    runner,  # flexspec.engine.model_runner.ModelRunner
    inp,  # ModelInput of a decode-only step (logits rows = input rows)
    target: torch.Tensor,  # [T] int64 the target's token at every row
    starts: torch.Tensor,  # [S] int64 each sequence's first row
    num_drafts: torch.Tensor,  # [S] int64
    drafts: torch.Tensor,  # [S, K] int64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager device-side step's verification of ``inp``'s draft trees (``accept_tree_drafts``; chains where a
    sequence has none) and the K/V moves of the accepted nodes (``tree_move_pairs``, ``runner.move_kv``).
    Returns (tokens [S, K + 1], accepted [S], path [S, K]). Sync-free."""
    K = drafts.shape[1]
    parents, slots = tree_rows(inp, K)
    dev = torch.tensor([*parents, *slots], dtype=torch.int64).to(runner.device, non_blocking=True)
    S = len(inp.query_lens)
    tokens, accepted, path = accept_tree_drafts(target, starts, num_drafts, drafts, dev[: S * K].view(S, K))
    if K:
        runner.move_kv(*tree_move_pairs(dev[S * K :].view(S, K + 1), path, accepted))
    return tokens, accepted, path
