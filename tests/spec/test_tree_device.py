"""Draft trees on the device (``flexspec.spec.tree_device``) against the host versions (``flexspec.spec.tree``),
and the captured tail of a tree step (``FusedVerifyGraphs`` over a tree decode graph, uncaptured on CPU) against
the eager device-side step, step for step.

- (``flexspec_kernels.draft_tree``'s kernels: tests/kernels/test_draft_tree_kernels.py)
- ``accept_tree_drafts`` = ``walk`` on random trees (siblings distinct, random target tokens), and on chains =
  ``accept_deterministic_drafts``; ``tree_move_pairs`` applied as one gather + scatter = ``move_slots``' moves.
- ``cut_tree`` keeps a tree, renumbers parents.
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.cuda_graphs import DecodeGraphs
from flexspec.engine.llm_engine import LLMEngine
from flexspec.engine.model_runner import verification_query_lens
from flexspec.spec.tree import cut_tree, depths, move_slots, walk
from flexspec.spec.tree_device import tree_move_pairs
from flexspec.spec.verifier import accept_deterministic_drafts
from flexspec_kernels.draft_tree import accept_tree_drafts
from tests.conftest import random_tree
from tests.spec.conftest import RAW_PROMPTS, on_worker_outputs, spec_engine


@pytest.mark.parametrize("seed", range(4))
def test_accept_tree_drafts_and_moves_equal_the_host_walk(seed):
    py = random.Random(seed)
    for _ in range(100):
        S, K, vocab = py.randint(1, 5), py.randint(1, 20), py.choice([2, 3, 5])
        trees = [random_tree(py, py.randint(0, K), vocab) for _ in range(S)]
        num_drafts = [len(p) for p, _ in trees]
        parents = torch.tensor([p + [-1] * (K - len(p)) for p, _ in trees])
        drafts = torch.tensor([t + [0] * (K - len(t)) for _, t in trees])
        starts, row = [], 0
        for n in num_drafts:
            starts.append(row)
            row += 1 + n + py.randint(0, 2)
        target = torch.randint(0, vocab, (row + K + 1,))
        starts_t, nd = torch.tensor(starts), torch.tensor(num_drafts)
        tokens, accepted, path = accept_tree_drafts(target, starts_t, nd, drafts, parents)
        slots = torch.randperm(4000)[: S * (K + 1)].view(S, K + 1)
        cache = torch.arange(4000) * 3
        moved = cache.clone()
        src, dst = tree_move_pairs(slots, path, accepted)
        moved[dst] = cache[src]  # one gather, one scatter (duplicates carry equal values)
        expect = cache.clone()
        for s, ((tree, toks), start) in enumerate(zip(trees, starts)):
            emitted, want_path = walk(tree, toks, target[start : start + 1 + len(tree)].tolist())
            a = int(accepted[s])
            assert (a, tokens[s, : a + 1].tolist(), path[s, :a].tolist()) == (
                len(want_path),
                emitted,
                want_path,
            )
            for r_from, r_to in zip(*move_slots(want_path, 1)):
                expect[slots[s, r_to]] = cache[slots[s, r_from]]
        assert torch.equal(moved, expect)
        chain = torch.tensor([[-1, *range(K - 1)]] * S)
        tokens_c, accepted_c, path_c = accept_tree_drafts(target, starts_t, nd, drafts, chain)
        tokens_d, accepted_d = accept_deterministic_drafts(target, starts_t, nd, drafts)
        assert torch.equal(accepted_c, accepted_d)
        for s in range(S):
            a = int(accepted_c[s])
            assert tokens_c[s, : a + 1].tolist() == tokens_d[s, : a + 1].tolist()
            assert path_c[s, :a].tolist() == list(range(a))


def test_cut_tree_keeps_a_tree():
    parents = [-1, -1, 0, 1, 2, 0, 4]
    ids = [10, 11, 12, 13, 14, 15, 16]
    assert cut_tree(ids, parents, 7, 15) == (ids, parents)
    assert cut_tree(ids, parents, 4, 15) == (ids[:4], parents[:4])
    got_ids, got_parents = cut_tree(ids, parents, 7, 2)  # depths 1, 1, 2, 2, 3, 2, 4
    assert got_ids == [10, 11, 12, 13, 15] and got_parents == [-1, -1, 0, 1, 0]
    assert max(depths(got_parents)) == 2
    assert cut_tree(ids, parents, 7, 0) == ([], [])


# ---- the captured tail of tree steps (uncaptured on CPU) ----------------------------------------------------
TREE = {
    "method": "dflash",
    "model": "smollm2-135m-instruct-dflash",
    "execution": "decoupled",
    "draft_tree_topk": 4,
    "num_speculative_tokens": 15,
}


def run_tree_steps(eng, prompts, params, fused: bool):
    """Generate with the worker's fused tails (or none); returns outputs, every step's (emitted tokens, next
    drafts, next parents) and, per fused step, whether it replayed a tree graph's tail."""
    worker = eng.executor.runner.spec_worker
    tails, steps, tree_tails = worker.fused, [], []
    if not fused:
        worker.fused = {}

    def launch(inp, decode, tail, launch=worker._launch_fused):
        tree_tails.append(tail.tree)
        return launch(inp, decode, tail)

    def note(inp, out):
        steps.append((out.token_ids, out.draft_token_ids, out.draft_parents))

    worker._launch_fused = launch
    try:
        with on_worker_outputs(worker, note):
            outs = [o.token_ids for o in eng.generate(prompts, params)]
    finally:
        worker.fused = tails
        del worker._launch_fused
    return outs, steps, tree_tails


def fused_tree_engine(spec: dict, **overrides):
    """An engine whose runner replays uncaptured decode graphs of batch sizes 1, 2, 4 (chains of 1, 2, 4, 8, 16
    rows and the tree graph of 1 + nodes rows) and whose worker has their uncaptured tails."""
    eng = spec_engine(spec, max_num_seqs=4, **overrides)
    runner = eng.executor.runner
    worker = runner.spec_worker
    layers = tuple(worker.drafter.capture_layers)
    sizes, q_tree = [1, 2, 4], 1 + spec["num_speculative_tokens"]
    runner.graphs = [DecodeGraphs(runner, sizes, capture=False)] + [
        DecodeGraphs(runner, sizes, query_len=q, capture_layers=layers, capture=False)
        for q in [1, *verification_query_lens(worker.drafter.max_chain_drafts)]
    ]
    runner.graphs.append(
        DecodeGraphs(runner, sizes, query_len=q_tree, capture_layers=layers, capture=False, tree=True)
    )
    runner.graphs.sort(key=lambda g: (g.q, g.tree))
    worker.capture_fused(runner.graphs, capture=False)
    assert (q_tree, True) in worker.fused
    return eng


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_tree_tail_equals_the_eager_device_side_step(plain_128, batch):
    """Tree steps replay the tree graph's tail (batch 3: one dummy sequence), and every step's emitted tokens
    and next trees equal the eager device-side path's, outputs plain decoding's."""
    eng = fused_tree_engine(TREE)
    prompts, want = plain_128
    prompts, want = prompts[:batch], [w[:40] for w in want[:batch]]
    params = SamplingParams(max_tokens=40, temperature=0)
    f_outs, f_steps, f_tails = run_tree_steps(eng, prompts, params, True)
    e_outs, e_steps, e_tails = run_tree_steps(eng, prompts, params, False)
    assert f_outs == e_outs == want
    assert f_steps == e_steps
    assert sum(f_tails) > 3 and not e_tails  # tree steps ran the tree graph's tail
    assert any(parents is not None for *_, parents in f_steps)


@pytest.mark.slow
def test_fused_tree_tail_near_max_model_len(plain_128):
    """A tree graph of 32 rows near max_model_len 140 (the review's case): the tail's padded rows, written
    nowhere, must not take the drafter positions past its rotary table (max_model_len + B rows); outputs are
    plain decoding's, cut at max_model_len."""
    eng = fused_tree_engine({**TREE, "draft_tree_topk": 8, "num_speculative_tokens": 31}, max_model_len=140)
    prompts, want = plain_128
    long = [i for i, p in enumerate(prompts) if 90 <= len(p) < 130][:2]
    assert long, "no prompt of 90-129 tokens"
    params = SamplingParams(max_tokens=64, temperature=0)
    outs, _, tails = run_tree_steps(eng, [prompts[i] for i in long], params, True)
    assert outs == [want[i][: min(64, 140 - len(prompts[i]))] for i in long]
    assert sum(tails) > 0


@pytest.mark.gpu
def test_captured_tree_tail_on_gpu_is_exact():
    """On the GPU (fp32) the tree tails are captured: a batch of 5 (graphs of batch size 8) and a batch of 1 emit
    plain decoding's tokens and the eager device-side path's; tree steps replay the tree graph's tail."""
    args = {"device": "cuda", "dtype": "float32", "max_num_seqs": 8, "max_model_len": 1024}
    eng = spec_engine(TREE, speculation_profile_steps=0, **args)
    assert (16, True) in eng.executor.runner.spec_worker.fused, "no tree tail was captured"
    plain = LLMEngine(EngineConfig(**args))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for batch in (RAW_PROMPTS, RAW_PROMPTS[:1]):
        want = [o.token_ids for o in plain.generate(batch, params)]
        f_outs, f_steps, f_tails = run_tree_steps(eng, batch, params, True)
        e_outs, _, e_tails = run_tree_steps(eng, batch, params, False)
        assert f_outs == e_outs == want
        assert sum(f_tails) > 3 and not e_tails
        assert any(parents is not None for *_, parents in f_steps)
