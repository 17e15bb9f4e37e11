"""Draft trees on the device (``flexspec_kernels.draft_tree``).

- Construction: the torch reference and the Triton kernel (under the interpreter on CPU) against the host's
  best-first search (``flexspec.spec.tree.top_paths`` + ``paths_to_tree``) on random per-depth candidates with
  distinct products: budgets below and above the number of candidate nodes, thresholds, per-sequence depth
  limits (none, partial, 0 or below); the kernel's size limits.
- Verification: the Triton kernel against the torch reference on random trees of 1-62 nodes, cut or not.
"""

from __future__ import annotations

import random

import pytest
import torch

from flexspec.spec.tree import paths_to_tree, top_paths
from flexspec_kernels.draft_tree import (
    accept_tree_drafts_ref,
    accept_tree_drafts_triton,
    tree_top_paths,
    tree_top_paths_ref,
    tree_top_paths_triton,
)
from tests.conftest import random_tree


def random_candidates(rng: torch.Generator, S: int, D: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, D, R] sorted probabilities (each depth's sum < 1) and distinct token ids per depth."""
    p = torch.rand(S, D, R, generator=rng, dtype=torch.float64) + 1e-3
    p = p / p.sum(-1, keepdim=True) * torch.rand(S, D, 1, generator=rng, dtype=torch.float64).clamp(min=0.05)
    ids = torch.stack([torch.randperm(100, generator=rng)[:R] for _ in range(S * D)]).view(S, D, R)
    return p.sort(-1, descending=True).values, ids


def check(fn, seed: int, cases: int, device, max_depth_: int = 15, max_nodes: int = 40) -> None:
    rng = torch.Generator().manual_seed(seed)
    py = random.Random(seed)
    for _ in range(cases):
        S, D, R, N = py.randint(1, 4), py.randint(1, max_depth_), py.randint(1, 6), py.randint(1, max_nodes)
        threshold = py.choice([0.0, 0.001, 0.05, 0.3])
        probs, ids = random_candidates(rng, S, D, R)
        max_depth = None if py.random() < 0.3 else torch.randint(-1, D + 2, (S, 2), generator=rng)[:, 0]
        top = torch.cat([probs, ids.double()], -1)
        drafts, parents, count = fn(
            top.to(device), N, threshold, None if max_depth is None else max_depth.to(device)
        )
        assert drafts.shape == parents.shape == (S, N) and count.shape == (S,)
        for s in range(S):
            deepest = D if max_depth is None else max(int(max_depth[s]), 0)
            want = paths_to_tree(top_paths(probs[s, :deepest].tolist(), N, threshold), ids[s].tolist())
            c = int(count[s])
            assert (drafts[s, :c].tolist(), parents[s, :c].tolist()) == want, (S, D, R, N, threshold)


@pytest.mark.parametrize("seed", range(5))
def test_reference_equals_the_host_search(seed):
    check(tree_top_paths_ref, seed, 40, torch.device("cpu"))


def test_triton_equals_the_host_search(device):
    """Smaller trees on CPU: the interpreter takes ~5 s per case of 15 depths x 64 nodes."""
    big = device.type == "cuda"
    check(tree_top_paths_triton, 100, 60 if big else 12, device, 15 if big else 6, 40 if big else 20)


def test_dispatch_and_limits(device):
    probs, ids = random_candidates(torch.Generator().manual_seed(0), 2, 15, 4)
    top = torch.cat([probs, ids.double()], -1).to(device)
    want = tree_top_paths_ref(top, 15)
    for backend in ("triton", "torch", "auto"):
        got = tree_top_paths(top, 15, backend=backend)
        assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want)), backend
    with pytest.raises(ValueError, match="out of range"):
        tree_top_paths_triton(top, 65)
    wide = torch.cat([probs.repeat(1, 1, 5), ids.double().repeat(1, 1, 5)], -1)  # R = 20
    with pytest.raises(ValueError, match="out of range"):
        tree_top_paths_triton(wide.to(device), 15)
    assert tree_top_paths(wide.to(device), 15)[0].shape == (
        2,
        15,
    )  # auto: the reference beyond the kernel's sizes


def random_trees(py: random.Random, S: int, K: int, vocab: int) -> tuple[list, list, list[int]]:
    """S random trees of up to K nodes, padded to K: (parents, tokens, node counts)."""
    trees = [random_tree(py, py.randint(0, K), vocab) for _ in range(S)]
    parents = [par + [-1] * (K - len(par)) for par, _ in trees]
    tokens = [tok + [0] * (K - len(tok)) for _, tok in trees]
    return parents, tokens, [len(par) for par, _ in trees]


@pytest.mark.parametrize("K", [1, 7, 15, 31, 62])
def test_accept_tree_drafts_triton_equals_the_reference(K, device):
    """The reference equals the host walk (tests/spec/test_tree_device.py); the kernel equals the reference on
    every column that means something: tokens[:a + 1], accepted, path[:a] (and path = k beyond)."""
    py = random.Random(K)
    for _ in range(4 if device.type == "cpu" else 30):
        S, vocab = py.randint(1, 5), py.choice([2, 3, 5])
        parents, tokens, sizes = random_trees(py, S, K, vocab)
        num_drafts = [py.randint(0, n) if py.random() < 0.3 else n for n in sizes]  # some cut to a prefix
        starts = [s * (K + 3) for s in range(S)]
        target = torch.randint(0, vocab, (S * (K + 3) + 1,), generator=torch.Generator().manual_seed(K))
        args = [torch.tensor(x) for x in (starts, num_drafts, tokens, parents)]
        want = accept_tree_drafts_ref(target, *args)
        # strided inputs, as the fused tail passes them: columns of its staged int64 rows
        staged = torch.cat([args[0][:, None], args[1][:, None], args[2], args[3]], 1).to(device)
        strided = (staged[:, 0], staged[:, 1], staged[:, 2 : 2 + K], staged[:, 2 + K :])
        assert not strided[1].is_contiguous() or S == 1
        got = accept_tree_drafts_triton(target.to(device), *strided)
        tokens_w, accepted_w, path_w = want
        tokens_g, accepted_g, path_g = (g.cpu() for g in got)
        assert torch.equal(accepted_g, accepted_w)
        assert torch.equal(path_g, path_w)
        for s in range(S):
            a = int(accepted_w[s])
            assert tokens_g[s, : a + 1].tolist() == tokens_w[s, : a + 1].tolist()
