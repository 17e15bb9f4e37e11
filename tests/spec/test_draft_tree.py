"""DFlash draft trees (``draft_tree_topk`` > 1, ``flexspec.spec.tree``).

Checks (``flexspec.spec.tree`` itself: tests/spec/test_tree_utils.py):
- With the shipped drafter (smollm2-135m-instruct-dflash, block 16), trees of topk 4 / 15 nodes and topk 8 /
  31 nodes are exact at T=0 against plain decoding at batch 1 and on a mixed batch of 4 real prompts, trees
  are really verified and nodes off the first-child chain are accepted (their K/V moved), and the tree's mean
  acceptance length beats the chain's on the same prompts.
- Trees cut by the scheduler's token budget (topological order: a prefix of a tree is a tree), sequences
  preempted under KV-cache pressure and trees shrunk to the room left below max_model_len stay exact.
- Seeded sampling at T=0.8: the tree engine emits plain decoding's tokens for the same SamplingParams.
- logprobs=2 at T=0: emitted tokens, their logprobs and top-2 equal plain decoding's.
- Config: ``draft_tree_topk`` outside 1..16 is rejected naming the field; DSpark (chains only) and the
  methods without the field reject it.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
from pydantic import ValidationError

from configs import EngineConfig, SamplingParams
from flexspec.spec.tree import (
    is_chain,
)
from tests.conftest import plain_outputs, real_prompts
from tests.spec.conftest import on_worker_outputs, spec_engine

DRAFTER = "smollm2-135m-instruct-dflash"
MAX_TOKENS = 48
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def dflash(topk: int, k: int, **extra) -> dict:
    return {
        "method": "dflash",
        "model": DRAFTER,
        "execution": "decoupled",
        "draft_tree_topk": topk,
        "num_speculative_tokens": k,
        **extra,
    }


# ---- config --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk", [0, 17, -1])
def test_draft_tree_topk_out_of_range_is_rejected(topk):
    with pytest.raises(ValidationError) as e:
        EngineConfig(device="cpu", speculative_config=dflash(topk, 15))
    assert "draft_tree_topk" in str(e.value)


def test_dspark_rejects_trees():
    cfg = {"method": "dspark", "model": DRAFTER, "draft_tree_topk": 2}
    with pytest.raises(ValidationError) as e:
        EngineConfig(device="cpu", speculative_config=cfg)
    assert "draft_tree_topk" in str(e.value)


@pytest.mark.parametrize(
    "cfg",
    [
        {"method": "eagle3", "model": "x"},
        {"method": "draft_model", "model": "x"},
        {"method": "ngram"},
        {"method": "mtp"},
        {"method": "flexdraft", "model": "x"},
    ],
)
def test_other_methods_have_no_trees(cfg):
    with pytest.raises(ValidationError) as e:
        EngineConfig(device="cpu", speculative_config={**cfg, "draft_tree_topk": 4})
    assert "draft_tree_topk" in str(e.value)


def test_tree_config_accepted():
    spec = EngineConfig(device="cpu", speculative_config=dflash(16, 64)).speculative_config
    assert spec.draft_tree_topk == 16 and spec.num_speculative_tokens == 64
    dspark = EngineConfig(device="cpu", speculative_config={"method": "dspark", "model": DRAFTER})
    assert dspark.speculative_config.draft_tree_topk == 1


# ---- engines -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """Four real prompts: GSM8K x2, HumanEval x2 (mixed lengths)."""
    return real_prompts(engine, n_each=2)[:4]


@pytest.fixture(scope="module")
def ref(plain_128, prompts) -> list[list[int]]:
    return plain_outputs(plain_128, prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def ref1(engine, prompts) -> list[int]:
    """Plain greedy output of the first prompt alone (batch 1)."""
    return engine.generate(prompts[:1], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def tree4():
    return spec_engine(dflash(4, 15))


@pytest.fixture(scope="module")
def tree8():
    return spec_engine(dflash(8, 31))


@pytest.fixture(scope="module")
def tree4_host():
    """Trees verified and built on the host (the general path)."""
    return spec_engine(dflash(4, 15, device_verification=False))


class TreeLog:
    """What the spec worker settled: per verified tree (parents, accepted path), and move_kv calls."""

    def __init__(self) -> None:
        self.trees: list[tuple[list[int], list[int]]] = []
        self.moves = 0  # move_kv calls with slots to move
        self.moved_slots = 0
        self.cut = 0  # trees verified with fewer nodes than proposed (the scheduler's token budget)

    @property
    def off_first_child(self) -> int:
        """Accepted nodes that are not their parent's first child (the chain DFlash would have drafted)."""
        count = 0
        for parents, path in self.trees:
            for node in path:
                count += any(parents[j] == parents[node] for j in range(node))
        return count


@contextlib.contextmanager
def tree_log(eng):
    """Log the trees an engine verifies, on the general path (``_settle_trees``, ``move_kv`` with slot lists)
    and on the device-side path (``_accept_trees``: its path tensor read back here)."""
    worker = eng.executor.runner.spec_worker
    runner = worker.runner
    log = TreeLog()
    settle, move, accept = worker._settle_trees, runner.move_kv, worker._accept_trees

    def note_cuts(inp):
        running = {seq.seq_id: seq for seq in eng.scheduler.running}  # their drafts: the proposed trees
        for sid, tree, d in zip(inp.seq_ids, inp.draft_parents, inp.num_draft_tokens):
            proposed = running[sid].draft_parents if sid in running else None
            log.cut += tree is not None and proposed is not None and len(proposed) > d

    def settle_logged(inp, emitted):
        note_cuts(inp)
        paths = settle(inp, emitted)
        for tree, path in zip(inp.draft_parents, paths):
            if tree is not None and path is not None:
                log.trees.append((list(tree), list(path)))
        return paths

    def accept_logged(inp, *args):
        note_cuts(inp)
        tokens, accepted, path = accept(inp, *args)
        for tree, a, row in zip(inp.draft_parents, accepted.tolist(), path.tolist()):
            if tree is not None:
                log.trees.append((list(tree), row[:a]))
                moved = sum(node != k for k, node in enumerate(row[:a]))
                log.moves += moved > 0
                log.moved_slots += moved
        return tokens, accepted, path

    def move_logged(src, dst):
        assert len(src) == len(dst)
        if isinstance(src, list) and src:  # the device path's moves are counted from its paths
            log.moves += 1
            log.moved_slots += len(src)
        return move(src, dst)

    worker._settle_trees, runner.move_kv, worker._accept_trees = settle_logged, move_logged, accept_logged
    try:
        yield log
    finally:
        del worker._settle_trees, runner.move_kv, worker._accept_trees  # back to the class's methods


def mal_of(eng, prompts, params) -> tuple[list[list[int]], float]:
    """Outputs and the mean acceptance length of this generate call alone."""
    m = eng.spec_metrics
    drafts, accepted = m.num_drafts, m.num_accepted_tokens
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    n = m.num_drafts - drafts
    assert n > 0, "nothing was verified"
    return outs, 1.0 + (m.num_accepted_tokens - accepted) / n


@pytest.fixture(scope="module")
def greedy_runs(request, prompts):
    """name -> (outputs, MAL, TreeLog) of a greedy generate of the four prompts, each computed once."""
    cache: dict[str, tuple[list[list[int]], float, TreeLog]] = {}

    def run(name: str):
        if name not in cache:
            eng = spec_engine(dflash(1, 15)) if name == "chain" else request.getfixturevalue(name)
            with tree_log(eng) as log:
                outs, mal = mal_of(eng, prompts, GREEDY)
            cache[name] = (outs, mal, log)
        return cache[name]

    return run


@pytest.mark.parametrize("which", ["tree4", "tree8", "tree4_host"])
def test_trees_exact_greedy_batch4(greedy_runs, which, ref):
    outs, mal, log = greedy_runs(which)
    assert outs == ref
    assert log.trees and any(not is_chain(p) for p, _ in log.trees), "no tree was verified"
    assert log.off_first_child > 0 and log.moves > 0, "no node off the first-child chain was accepted"
    assert mal > 1.5


@pytest.mark.parametrize("which", ["tree4", "tree8"])
def test_trees_exact_greedy_batch1(request, which, prompts, ref1):
    eng = request.getfixturevalue(which)
    with tree_log(eng) as log:
        out = eng.generate(prompts[:1], GREEDY)[0].token_ids
    assert out == ref1
    assert log.trees and log.off_first_child > 0 and log.moves > 0


def test_device_side_trees_equal_the_general_path_step_for_step(tree4, tree4_host, prompts, ref):
    """The device-side tree step (``flexspec.spec.tree_device``: trees built from the block's candidates,
    verified, K/V moved on the device, one readback) emits the general path's tokens and proposes its trees
    (tokens and parents), step for step."""
    runs = []
    for eng in (tree4, tree4_host):
        steps: list = []
        worker = eng.executor.runner.spec_worker

        def note(inp, out, steps=steps):
            steps.append(
                (out.token_ids, out.draft_token_ids, out.draft_parents, inp.draft_parents is not None)
            )

        with on_worker_outputs(worker, note):
            outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
        runs.append((outs, steps))
    (dev_outs, dev_steps), (host_outs, host_steps) = runs
    assert dev_outs == host_outs == ref
    assert dev_steps == host_steps
    assert sum(tree for *_, tree in dev_steps) > 5  # steps that verified trees


def test_tree_nodes_and_chain_limit(tree8):
    """31 nodes per tree, but a chain of this block-16 drafter is at most 15 drafts deep: verification graphs of
    chains are captured up to 16 rows (not 32)."""
    drafter = tree8.executor.runner.spec_worker.drafter
    assert (drafter.num_speculative_tokens, drafter.max_chain_drafts) == (31, 15)
    assert drafter.proposes_on_device and drafter.device_trees  # trees are built on the device
    # the policy's optimistic prior (before any verification) is a path of the block's depth, not 1 + 31 nodes
    policy = copy.copy(tree8.policy)
    policy.prior_tokens_per_step, policy.acceptance = None, []
    assert policy.max_chain_drafts == 15 and policy.prior() == 16.0


def test_chain_longer_than_the_block_is_cut_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="flexspec.spec.dflash"):
        eng = spec_engine(dflash(1, 31))
    assert eng.executor.runner.spec_worker.drafter.num_speculative_tokens == 15
    assert "num_speculative_tokens 31" in caplog.text and "using 15" in caplog.text


def test_tree_mal_beats_the_chain(greedy_runs, ref):
    chain_outs, chain_mal, chain_log = greedy_runs("chain")
    assert chain_outs == ref and not chain_log.trees and chain_log.moves == 0  # topk 1: chains only
    for which in ("tree4", "tree8"):
        outs, mal, _ = greedy_runs(which)
        assert outs == ref
        # measured 2.71 (topk 4, 15 nodes), 2.88 (topk 8, 31 nodes) vs 2.11 (chain of 15) on these prompts
        assert mal > chain_mal, (which, mal, chain_mal)


def test_trees_cut_by_the_token_budget_stay_exact(prompts, ref):
    """A budget of 24 tokens for 4 sequences with 16-row queries: trees are cut to a prefix (still a tree, by
    topological order), some sequences wait; prompts are prefilled in chunks."""
    eng = spec_engine(dflash(4, 15), max_num_batched_tokens=24, max_num_seqs=4)
    drafter = eng.executor.runner.spec_worker.drafter
    drafter._node_budget = lambda num_seqs: 15  # trees larger than the budget's share (see the next test)
    with tree_log(eng) as log:
        outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert outs == ref
    assert log.trees and log.off_first_child > 0
    assert log.cut > 0, "no tree was cut"


def test_trees_never_starve_running_requests(prompts, ref):
    """4 sequences, 31-node trees, a budget of 64 tokens (the review's case: trees of 1 + 31 tokens each left the
    last requests of a step without a token). The drafter gives each tree an even share of the budget
    (``_node_budget``: 15 nodes here); with that share lifted, the scheduler still leaves one token per queued
    request when it fits drafts, so every step that verifies drafts schedules every running request with drafts."""
    eng = spec_engine(dflash(8, 31), max_num_batched_tokens=64, max_num_seqs=4)
    drafter = eng.executor.runner.spec_worker.drafter
    assert drafter._node_budget(4) == 15
    drafter._node_budget = lambda num_seqs: 31  # trees of 32 tokens: 4 of them are twice the budget
    sched = eng.scheduler
    schedule, starved = sched.schedule, []

    def checked(*args, **kwargs):
        waiting = {s.seq_id for s in sched.running if s.draft_token_ids}
        out = schedule(*args, **kwargs)
        if out is not None and any(s.num_draft_tokens for s in out.scheduled):
            starved.append(len(waiting - {s.seq.seq_id for s in out.scheduled}))
        return out

    sched.schedule = checked
    with tree_log(eng) as log:
        outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert outs == ref
    assert log.trees and starved and not any(starved), starved


def test_trees_under_preemption_stay_exact(prompts, ref):
    """12 KV blocks (192 tokens) for four sequences of 56-125 prompt tokens + 48: sequences are preempted
    (their drafts and trees dropped) and recomputed."""
    eng = spec_engine(dflash(4, 15), num_kv_blocks=12, max_model_len=192)
    with tree_log(eng) as log:
        outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert eng.stats.num_preemptions > 0
    assert outs == ref
    assert log.off_first_child > 0 and log.moves > 0


def test_trees_at_max_model_len_stay_exact(prompts, ref):
    """max_model_len 140 for prompts of 56-125 tokens: trees of 31 nodes shrink to the room left (a node per
    position at most) and outputs are plain decoding's, cut at max_model_len."""
    eng = spec_engine(dflash(8, 31), max_model_len=140)
    with tree_log(eng) as log:
        outs = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    assert outs == [r[: 140 - len(p)] for r, p in zip(ref, prompts)]
    assert any(len(o) < MAX_TOKENS for o in outs)
    assert log.off_first_child > 0


def test_trees_seeded_sampling_equals_plain(engine, tree4, prompts):
    """Each node's row samples the node's output position with the request's seed, as plain decoding does."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1234)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    with tree_log(tree4) as log:
        got = [o.token_ids for o in tree4.generate(prompts, params)]
    assert log.trees and any(not is_chain(p) for p, _ in log.trees)
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        assert g == w, f"prompt {i}: first difference at output token {first}"
    assert log.off_first_child > 0


def run_with_logprobs(eng, prompts, params) -> list[tuple[list[int], list]]:
    ids = [eng.add_request(p, params) for p in prompts]
    got: dict[str, tuple[list[int], list]] = {i: ([], []) for i in ids}
    while eng.has_unfinished:
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(o.new_logprobs)
    return [got[i] for i in ids]


def test_trees_logprobs_equal_plain(engine, tree4, prompts):
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=2)
    want = run_with_logprobs(engine, prompts, params)
    with tree_log(tree4) as log:
        got = run_with_logprobs(tree4, prompts, params)
    assert log.off_first_child > 0
    for (g_ids, g_lps), (w_ids, w_lps) in zip(got, want):
        assert g_ids == w_ids
        assert len(g_lps) == len(w_lps) == len(w_ids)
        for g, w, tok in zip(g_lps, w_lps, w_ids):
            assert g.token_id == w.token_id == tok
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
            assert [t for t, _ in g.top] == [t for t, _ in w.top] and len(g.top) == 2
            assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-4)
