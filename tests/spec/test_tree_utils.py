"""``flexspec.spec.tree`` against brute force: ``top_paths`` is the top-N set of rank paths by probability product
(prefix-closed, parents before children, cut by the threshold), ``paths_to_tree`` / ``depths`` / ``is_chain``,
``tree_mask`` is the ancestor mask, ``walk`` / ``accepted_path`` on a hand-made tree and on random ones,
``move_slots`` (empty for a chain), ``check_tree`` rejects bad parents and repeated sibling tokens."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flexspec.spec.tree import (
    accepted_path,
    check_tree,
    depths,
    is_chain,
    move_slots,
    paths_to_tree,
    top_paths,
    tree_mask,
    walk,
)


# ---- tree.py against brute force ---------------------------------------------------------------------------
def random_probs(rng: random.Random, depth: int, r: int) -> list[list[float]]:
    """[depth][r] distinct probabilities, each row sorted highest first (like a softmax's top-r)."""
    rows = []
    for _ in range(depth):
        raw = [rng.random() + 1e-3 for _ in range(r + 3)]
        total = sum(raw)
        rows.append(sorted((x / total for x in raw), reverse=True)[:r])
    return rows


def score(probs: list[list[float]], path: tuple[int, ...]) -> float:
    out = 1.0
    for d, rank in enumerate(path):
        out *= probs[d][rank]
    return out


def all_paths(depth: int, r: int) -> list[tuple[int, ...]]:
    return [p for n in range(1, depth + 1) for p in itertools.product(range(r), repeat=n)]


@pytest.mark.parametrize(
    "depth,r,budget", [(1, 1, 3), (1, 4, 2), (3, 1, 2), (3, 3, 7), (4, 3, 20), (5, 2, 62)]
)
def test_top_paths_is_the_brute_force_top_n(depth, r, budget):
    rng = random.Random(depth * 100 + r * 10 + budget)
    for _ in range(30):
        probs = random_probs(rng, depth, r)
        got = top_paths(probs, budget)
        ranked = sorted(all_paths(depth, r), key=lambda p: -score(probs, p))
        want = ranked[: min(budget, len(ranked))]
        assert len(got) == len(set(got)) == len(want)
        assert set(got) == set(want)
        # in order of score (parents before children), prefix-closed, and every rank-r path's rank r-1 sibling
        # is kept too (its product is higher)
        scores = [score(probs, p) for p in got]
        assert scores == sorted(scores, reverse=True)
        index = {p: i for i, p in enumerate(got)}
        for i, p in enumerate(got):
            assert all(0 <= rank < r for rank in p) and 1 <= len(p) <= depth
            if len(p) > 1:
                assert index[p[:-1]] < i
            if p[-1] > 0:
                assert (*p[:-1], p[-1] - 1) in index


@pytest.mark.parametrize("threshold", [0.0, 0.02, 0.1, 0.3, 0.99])
def test_top_paths_threshold(threshold):
    rng = random.Random(int(threshold * 1000))
    for _ in range(30):
        probs = random_probs(rng, 4, 3)
        budget = rng.randint(1, 40)
        got = top_paths(probs, budget, threshold)
        assert got, "at least one path"
        passing = [p for p in all_paths(4, 3) if score(probs, p) >= threshold]
        if not passing:
            assert got == [(0,)]  # the best single path only
            continue
        assert all(score(probs, p) >= threshold for p in got)
        ranked = sorted(passing, key=lambda p: -score(probs, p))
        assert set(got) == set(ranked[:budget])


def test_top_paths_edge_cases():
    assert top_paths([], 5) == []
    assert top_paths([[0.5, 0.3]], 0) == []
    assert top_paths([[0.9], [0.8], [0.7]], 10) == [(0,), (0, 0), (0, 0, 0)]  # R = 1: a chain
    assert top_paths([[0.9, 0.05], [0.8, 0.1]], 1) == [(0,)]


def test_paths_to_tree_depths_and_is_chain():
    rng = random.Random(5)
    for _ in range(20):
        probs = random_probs(rng, 5, 3)
        tokens = [rng.sample(range(1000), 3) for _ in range(5)]  # distinct candidates per depth, like topk
        paths = top_paths(probs, rng.randint(1, 30))
        ids, parents = paths_to_tree(paths, tokens)
        check_tree(parents, ids)
        assert depths(parents) == [len(p) for p in paths]
        for i, p in enumerate(paths):
            assert ids[i] == tokens[len(p) - 1][p[-1]]
            assert parents[i] == (paths.index(p[:-1]) if len(p) > 1 else -1)
        assert is_chain(parents) == all(set(p) == {0} for p in paths)
    assert is_chain([]) and is_chain([-1, 0, 1]) and not is_chain([-1, -1]) and not is_chain([-1, 0, 0])
    assert depths([-1, 0, 0, 1, -1, 4]) == [1, 2, 2, 3, 1, 2]


def random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(-1, i - 1) for i in range(n)]


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def test_tree_mask_is_the_ancestor_mask():
    rng = random.Random(0)
    for _ in range(50):
        n, prefix = rng.randint(0, 12), rng.randint(1, 4)
        parents = random_tree(rng, n)
        got = tree_mask(parents, prefix)
        size = prefix + n
        want = torch.zeros(size, size, dtype=torch.bool)
        for i in range(size):
            for j in range(size):
                if j < prefix:
                    want[i, j] = j <= i  # committed rows: causal; every node sees all of them
                elif i >= prefix:
                    want[i, j] = (j - prefix) in ancestors_or_self(parents, i - prefix)
        assert got.dtype == torch.bool and torch.equal(got, want), (parents, prefix)
    # a chain's mask is causal
    assert torch.equal(tree_mask([-1, 0, 1, 2], 3), torch.ones(7, 7, dtype=torch.bool).tril())


# root -> A(10) -> C(12) -> F(15)
#              -> D(13)
#      -> B(11) -> E(14)
PARENTS = [-1, -1, 0, 0, 1, 2]
DRAFTS = [10, 11, 12, 13, 14, 15]


@pytest.mark.parametrize(
    "target,emitted,path",
    [
        ({0: 42}, [42], []),  # root's token is no child: nothing accepted
        ({0: 11, 2: 14, 5: 99}, [11, 14, 99], [1, 4]),  # the root's second child, then its child
        ({0: 10, 1: 13, 4: 7}, [10, 13, 7], [0, 3]),  # a second child at depth 2
        ({0: 10, 1: 12, 3: 15, 6: 77}, [10, 12, 15, 77], [0, 2, 5]),  # a whole branch + bonus
        ({0: 11, 2: 12}, [11, 12], [1]),  # 12 is a child of A, not of B
    ],
)
def test_walk_on_a_hand_made_tree(target, emitted, path):
    rows = [target.get(i, -1) for i in range(len(PARENTS) + 1)]  # -1: rows the walk must not need
    got_emitted, got_path = walk(PARENTS, DRAFTS, rows)
    assert (got_emitted, got_path) == (emitted, path)
    assert accepted_path(PARENTS, DRAFTS, got_emitted) == path


def test_walk_and_accepted_path_on_random_trees():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(0, 15)
        parents = random_tree(rng, n)
        drafts = [0] * n
        for i, p in enumerate(parents):  # distinct tokens among siblings, from a small vocabulary
            used = {drafts[j] for j in range(i) if parents[j] == p}
            drafts[i] = rng.choice([t for t in range(16) if t not in used])
        check_tree(parents, drafts)
        # each row's target token: mostly one of its node's children's (accepted), else any token
        target = []
        for node in range(-1, n):
            kids = [drafts[i] for i in range(n) if parents[i] == node]
            target.append(rng.choice(kids) if kids and rng.random() < 0.7 else rng.randrange(16))
        emitted, path = walk(parents, drafts, target)
        # brute force: follow the target from the root, picking the child carrying its token
        node, want_path = -1, []
        while True:
            kids = [i for i in range(n) if parents[i] == node and drafts[i] == target[node + 1]]
            if not kids:
                break
            node = kids[0]
            want_path.append(node)
        assert path == want_path
        assert emitted == [drafts[i] for i in path] + [target[path[-1] + 1 if path else 0]]
        assert [depths(parents)[i] for i in path] == list(range(1, len(path) + 1))
        assert accepted_path(parents, drafts, emitted) == path
        src, dst = move_slots(path, 100)
        assert all(s != d for s, d in zip(src, dst))
        moved = dict(zip(dst, src))
        assert [moved.get(100 + k, 100 + k) for k in range(len(path))] == [100 + i for i in path]


def test_move_slots():
    for k in range(6):
        assert move_slots(list(range(k)), 7) == ([], [])  # a chain stays where it is
    assert move_slots([1, 4], 10) == ([11, 14], [10, 11])
    assert move_slots([0, 3, 5], 2) == ([5, 7], [3, 4])


@pytest.mark.parametrize(
    "parents,drafts,match",
    [
        ([-1, 0], [1], "parents for"),
        ([0], [1], "parent 0"),  # a node can't be its own parent
        ([-1, 1, 0], [1, 2, 3], "parent 1"),  # a later (here: its own) node
        ([-1, 2, 0], [1, 2, 3], "parent 2"),
        ([-2], [1], "parent -2"),
        ([-1, -1], [5, 5], "repeats token 5"),
        ([-1, 0, 0], [5, 6, 6], "repeats token 6"),
    ],
)
def test_check_tree_rejects(parents, drafts, match):
    with pytest.raises(ValueError, match=match):
        check_tree(parents, drafts)


def test_check_tree_accepts():
    check_tree([], [])
    check_tree([-1, 0, 1], [5, 5, 5])  # the same token at different depths
    check_tree([-1, -1, 0, 1], [5, 6, 7, 7])  # the same token under different parents
    check_tree(PARENTS, DRAFTS)
