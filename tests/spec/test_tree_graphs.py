"""Draft trees in the decode-graph layout (``DecodeGraphs(tree=True)``): each row's attention mask is a staged
input (``tree_mask_bits``), so tree verification replays a CUDA graph on the GPU. On CPU the same padded layout
runs uncaptured (``capture=False``); outputs must equal plain decoding's, with trees verified through it, next to
chains, padded rows and dummy sequences."""

from __future__ import annotations

import random

import pytest
import torch

from configs import SamplingParams
from flexspec.engine.cuda_graphs import DecodeGraphs
from flexspec.spec.tree import tree_mask, tree_mask_bits
from tests.conftest import plain_outputs, real_prompts
from tests.spec.conftest import spec_engine

TREE = {
    "method": "dflash",
    "model": "smollm2-135m-instruct-dflash",
    "execution": "decoupled",
    "draft_tree_topk": 4,
    "num_speculative_tokens": 11,
}


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


@pytest.mark.parametrize("num_prefix", [1, 3])
def test_mask_bits_are_the_tree_mask(num_prefix):
    rng = random.Random(num_prefix)
    for n in [0, 1, 5, 20]:
        parents = _random_tree(rng, n)
        mask = tree_mask(parents, num_prefix)
        bits = tree_mask_bits(parents, num_prefix)
        size = num_prefix + n
        as_mask = torch.tensor([[(b >> j) & 1 for j in range(size)] for b in bits], dtype=torch.bool)
        assert torch.equal(as_mask, mask)


@pytest.fixture(scope="module")
def tree_graph_eng():
    """A tree-drafting DFlash engine whose runner replays uncaptured decode graphs: plain (q=1, with and
    without the drafter's layers) and the tree family (q = 1 + 11 nodes)."""
    eng = spec_engine(TREE, max_num_seqs=4)
    runner = eng.executor.runner
    layers = tuple(runner.spec_worker.drafter.capture_layers)
    sizes = [1, 2, 4]
    runner.graphs = [
        DecodeGraphs(runner, sizes, capture=False),
        DecodeGraphs(runner, sizes, query_len=1, capture_layers=layers, capture=False),
        DecodeGraphs(runner, sizes, query_len=12, capture_layers=layers, capture=False, tree=True),
    ]
    runner.graphs.sort(key=lambda g: (g.q, g.tree))
    return eng


@pytest.mark.parametrize("n", [1, 3])
def test_tree_graph_layout_is_exact(engine, plain_128, tree_graph_eng, n):
    prompts = real_prompts(engine, n_each=1)[:n]
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = plain_outputs(plain_128, prompts, 40)
    tree = tree_graph_eng.executor.runner.graphs[-1]
    assert tree.tree
    replays = []
    replay = tree.replay
    tree.replay = lambda inp, *a: replays.append(inp.draft_parents) or replay(inp, *a)
    try:
        outs = [o.token_ids for o in tree_graph_eng.generate(prompts, params)]
    finally:
        del tree.replay
    assert outs == ref
    trees = [t for parents in replays if parents for t in parents if t is not None]
    assert trees and any(
        len(set(t)) < len(t) for t in trees
    )  # real trees (a node with 2+ children) went through
