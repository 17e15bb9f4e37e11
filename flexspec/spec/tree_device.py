"""Draft trees on the device: building, verifying and settling a step's trees without a host sync.

The host versions (:mod:`flexspec.spec.tree`) walk Python lists; these do the same on fixed-shape tensors, so a
tree step can run as a chain step does (``SpecDecodeWorker``'s device-side path, captured in ``FusedVerifyGraphs``):
the target's verification forward, then acceptance, the K/V moves, the drafter's context and its next tree, and
one readback.

- ``flexspec_kernels.draft_tree.tree_top_paths`` (one Triton launch; its torch reference beside it) builds the
  trees: the N rank paths of highest probability product from a DFlash block's per-depth top-R candidates.
- ``flexspec_kernels.draft_tree.accept_tree_drafts`` (one Triton launch; its torch reference beside it):
  greedy tree verification (``flexspec.spec.tree.walk``).
- ``tree_move_pairs``: the KV slots that move so the cache holds the accepted path at its positions' slots
  (``flexspec.spec.tree.move_slots``), padded to a fixed count with copies of one real move.
"""

from __future__ import annotations

import torch

from flexspec.spec.tree import tree_parent_rows, tree_slot_rows
from flexspec_kernels.draft_tree import accept_tree_drafts


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
    parents, slots = tree_parent_rows(inp, K), tree_slot_rows(inp, K)
    dev = torch.tensor([*parents, *slots], dtype=torch.int64).to(runner.device, non_blocking=True)
    S = len(inp.query_lens)
    tokens, accepted, path = accept_tree_drafts(target, starts, num_drafts, drafts, dev[: S * K].view(S, K))
    if K:
        runner.move_kv(*tree_move_pairs(dev[S * K :].view(S, K + 1), path, accepted))
    return tokens, accepted, path
