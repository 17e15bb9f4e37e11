"""Draft trees: several candidates per depth, verified in one target forward (SpecInfer, arXiv 2305.09781;
EAGLE-2's dynamic trees, arXiv 2406.16858; Medusa's tree attention, arXiv 2401.10774).

A tree of n draft nodes is a list of draft tokens plus ``parents`` [n]: node i continues node ``parents[i]``
(-1: the root, i.e. the sequence's last committed token, the query's first row). Nodes are in topological
order (``parents[i] < i``), so any prefix of the list is a tree too (the scheduler may cut drafts to the token
budget), and siblings hold distinct tokens, so the emitted tokens name the accepted path. A chain of k drafts is
``parents = [-1, 0, .., k - 2]``; the engine carries ``None`` for it.

The target forward computes the query ``[root, node 0, .., node n-1]``: node i sits at position
``root + depth(i)`` and attends to the context, the root and its own ancestors (``tree_mask``); every row gets
logits. Verification walks from the root: the target's token at a row is accepted when a child of that row's
node carries it (``walk``). The accepted nodes' K/V then move to the slots of their positions (``move_slots``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

RankPath = tuple[int, ...]  # candidate rank at each depth, from depth 1


def top_paths(probs: Sequence[Sequence[float]], budget: int, threshold: float = 0.0) -> list[RankPath]:
    """The ``budget`` rank paths of highest probability product under per-depth candidate probabilities
    ``probs`` [depth][R] (each row sorted, highest first), in order of their product (parents before
    children), keeping only paths whose product is >= ``threshold`` (at least one path when ``budget`` > 0).

    Best-first search: a popped path adds its first child and its next sibling. With candidates of one block
    drafted in parallel (DFlash), the probability of a depth's candidate does not depend on the path above it,
    which is what makes this product the path's draft probability (EAGLE-2's score)."""
    if not probs or not probs[0] or budget <= 0:
        return []
    out: list[RankPath] = []
    heap: list[tuple[float, RankPath, float]] = [(-probs[0][0], (0,), 1.0)]  # (-score, path, parent's score)
    while heap and len(out) < budget:
        neg, path, parent = heapq.heappop(heap)
        if out and -neg < threshold:
            break  # popped in order of score: nothing later passes either
        out.append(path)
        d, r = len(path) - 1, path[-1]
        if d + 1 < len(probs):
            heapq.heappush(heap, (neg * probs[d + 1][0], (*path, 0), -neg))
        if r + 1 < len(probs[d]):
            heapq.heappush(heap, (-parent * probs[d][r + 1], (*path[:-1], r + 1), parent))
    return out


def paths_to_tree(paths: list[RankPath], tokens: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Rank paths (``top_paths``' order: parents first) and candidate tokens [depth][R] -> (draft tokens [n],
    parents [n])."""
    index = {p: i for i, p in enumerate(paths)}
    ids = [int(tokens[len(p) - 1][p[-1]]) for p in paths]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    return ids, parents


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (a child of the root has depth 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def check_tree(parents: Sequence[int], drafts: Sequence[int]) -> None:
    """Raises ValueError unless ``parents`` is a topologically ordered tree over ``drafts`` with distinct
    sibling tokens."""
    if len(parents) != len(drafts):
        raise ValueError(f"{len(parents)} parents for {len(drafts)} draft tokens")
    seen: set[tuple[int, int]] = set()
    for i, (p, t) in enumerate(zip(parents, drafts)):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not an earlier node or -1")
        if (p, t) in seen:
            raise ValueError(f"node {i} repeats token {t} under parent {p}")
        seen.add((p, t))


def tree_mask_bits(parents: Sequence[int], num_prefix: int) -> list[int]:
    """The attention mask of a query of ``num_prefix`` committed tokens (causal among themselves; the last one
    is the root) followed by the tree's nodes, one integer per query row: bit j set = the row sees query row j.
    A node sees every committed row, its ancestors and itself (CUDA graphs stage these: at most 63 rows)."""
    bits = [(1 << (i + 1)) - 1 for i in range(num_prefix)]
    prefix = bits[-1] if bits else 0
    for i, p in enumerate(parents):
        row = num_prefix + i
        bits.append((bits[num_prefix + p] if p >= 0 else prefix) | (1 << row))
    return bits


def tree_mask(parents: Sequence[int], num_prefix: int) -> torch.Tensor:
    """``tree_mask_bits`` as a [n_q, n_q] bool matrix: ``[i, j]`` = query row i sees row j."""
    size = num_prefix + len(parents)  # up to 65 rows on the eager path: Python ints, not int64
    return torch.tensor(
        [[(b >> j) & 1 for j in range(size)] for b in tree_mask_bits(parents, num_prefix)]
    ).bool()


def _children(parents: Sequence[int], drafts: Sequence[int]) -> dict[int, dict[int, int]]:
    """node (-1: the root) -> {child's token: child}."""
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(parents, drafts)):
        children.setdefault(p, {}).setdefault(t, i)
    return children


def walk(parents: Sequence[int], drafts: Sequence[int], target: Sequence[int]) -> tuple[list[int], list[int]]:
    """Greedy tree verification. ``target`` [n + 1]: the target's token at the root row (0) and at each node's
    row (1 + i), sampled as plain decoding samples that output position. Returns (emitted tokens: accepted
    drafts then the bonus or recovered token, accepted node indices along the path)."""
    children = _children(parents, drafts)
    node, emitted, path = -1, [], []
    while True:
        token = target[node + 1]
        emitted.append(token)
        nxt = children.get(node, {}).get(token)
        if nxt is None:
            return emitted, path
        path.append(nxt)
        node = nxt


def accepted_path(parents: Sequence[int], drafts: Sequence[int], emitted: Sequence[int]) -> list[int]:
    """The accepted node indices named by ``emitted`` (``walk``'s tokens): every rank derives them from the
    broadcast tokens."""
    children = _children(parents, drafts)
    node, path = -1, []
    for token in emitted[:-1]:
        node = children[node][token]
        path.append(node)
    return path


def move_slots(path: Sequence[int], first_draft_row: int) -> tuple[list[int], list[int]]:
    """Query rows to move after acceptance: accepted node ``path[k]`` (query row ``first_draft_row +
    path[k]``) belongs at row ``first_draft_row + k`` (its position's). Returns (source rows, destination
    rows), only where they differ (empty for a chain)."""
    src, dst = [], []
    for k, node in enumerate(path):
        if node != k:
            src.append(first_draft_row + node)
            dst.append(first_draft_row + k)
    return src, dst


def settle_trees(inp, emitted: list[list[int]]) -> tuple[list[list[int] | None], list[int], list[int]]:
    """After a step that verified draft trees (``inp``: its ``ModelInput``; ``emitted``: tokens per emitting
    sequence): [S] the accepted node indices per sequence (None: a chain or no emission) and the KV slots to move
    (sources, destinations), so the cache holds each accepted path at its positions' slots."""
    assert inp.draft_parents is not None
    paths: list[list[int] | None] = []
    src: list[int] = []
    dst: list[int] = []
    k = end = 0
    for s, tree in enumerate(inp.draft_parents):
        end += inp.query_lens[s]
        if not inp.samples[s]:
            paths.append(None)
            continue
        toks = emitted[k]
        k += 1
        if tree is None:
            paths.append(None)
            continue
        first = end - inp.num_draft_tokens[s]  # row of draft node 0
        path = accepted_path(tree, inp.input_ids[first:end], toks)
        paths.append(path)
        rows_from, rows_to = move_slots(path, first)
        src.extend(inp.slot_mapping[r] for r in rows_from)
        dst.extend(inp.slot_mapping[r] for r in rows_to)
    return paths, src, dst


def emitted_rows(
    first_rows: list[int],
    emitted: list[list[int]],
    drafts: list[list[int]],
    trees: list[list[int] | None] | None,
) -> list[int] | None:
    """Logits rows of the emitted tokens, flattened, where some sequence verified a draft tree (its tokens come
    from the root's row and the accepted nodes' rows); None: every sequence's rows are consecutive from
    ``first_rows``."""
    if trees is None:
        return None
    rows: list[int] = []
    for r0, toks, ds, tree in zip(first_rows, emitted, drafts, trees):
        if tree is None:
            rows.extend(range(r0, r0 + len(toks)))
        else:
            rows.extend([r0, *(r0 + 1 + node for node in accepted_path(tree, ds, toks))])
    return rows


def cut_tree(
    ids: list[int], parents: list[int], max_nodes: int, max_depth: int
) -> tuple[list[int], list[int]]:
    """A tree (topological order, best nodes first) cut to its first ``max_nodes`` nodes, then to the nodes at most
    ``max_depth`` deep (the tokens a sequence may still emit), parents renumbered. Both cuts keep every kept
    node's ancestors."""
    ids, parents = ids[:max_nodes], parents[:max_nodes]
    keep = [i for i, d in enumerate(depths(parents)) if d <= max_depth]
    if len(keep) == len(ids):
        return ids, parents
    index = {old: new for new, old in enumerate(keep)}
    return [ids[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


def tree_parent_rows(inp, max_drafts: int) -> list[int]:
    """A decode-only step's trees for device-side verification (``flexspec.spec.tree_device``), flattened: per
    sequence its K = ``max_drafts`` node parents (a chain's where ``inp.draft_parents[s]`` is None; -1 past its
    drafts)."""
    parents: list[int] = []
    trees = inp.draft_parents or [None] * len(inp.query_lens)
    for tree, d in zip(trees, inp.num_draft_tokens):
        parents.extend(tree if tree is not None else range(-1, d - 1))
        parents.extend([-1] * (max_drafts - d))
    return parents


def tree_slot_rows(inp, max_drafts: int) -> list[int]:
    """Per sequence of a decode-only step, flattened: the K + 1 KV slots of its root row and its K =
    ``max_drafts`` node rows (the root's slot past its drafts)."""
    slots: list[int] = []
    end = 0
    for n, d in zip(inp.query_lens, inp.num_draft_tokens):
        end += n
        root = end - d - 1
        slots.extend(inp.slot_mapping[root:end])
        slots.extend([inp.slot_mapping[root]] * (max_drafts - d))
    return slots
