"""DFlash's deferred context (``defer_context``): plain steps leave the drafter's context K/V for later, the
target keeps their hidden states per KV slot (``FeatureCache``), and the drafts, hence the accepted tokens,
equal those of writing the context in every plain step, while plain decode steps run no context step at all
(issue 6: a step the policy runs plainly must cost what it costs without a drafter)."""

from __future__ import annotations

import pytest
import torch

from configs import SamplingParams
from flexspec.models.features import FeatureCache
from flexspec.spec.policy import Decision
from tests.spec.conftest import RAW_PROMPTS, spec_engine

pytestmark = pytest.mark.slow  # among the longest modules: scheduled first

DFLASH = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4}


def test_feature_cache_stores_rows_by_slot_and_skips_padding():
    cache = FeatureCache((1, 4), num_slots=6, hidden_size=2, dtype=torch.float32, device="cpu")
    a = torch.arange(8.0).view(4, 2)
    b = 100 + torch.arange(8.0).view(4, 2)
    cache.store([a, b], torch.tensor([5, -1, 0, -1]))
    assert torch.equal(
        cache.gather(torch.tensor([5, 0])), torch.tensor([[0.0, 1, 100, 101], [4, 5, 104, 105]])
    )
    assert cache.data[1:5].abs().sum() == 0  # padded rows went to the scratch row only
    cache.store([a[:1], b[:1]], torch.tensor([0]))  # a slot is rewritten like its K/V (a recomputed position)
    assert torch.equal(cache.gather(torch.tensor([0])), torch.tensor([[0.0, 1, 100, 101]]))


def _run(prompts, defer: bool, plain_steps: int):
    """Fixed decisions (``plain_steps`` plain steps, then one that drafts), so both runs decide alike."""
    eng = spec_engine({**DFLASH, "defer_context": defer}, max_num_seqs=4)
    n = {"decisions": 0, "context_writes": 0}

    def decide(sched):
        n["decisions"] += 1
        return Decision("decoupled", 4) if n["decisions"] % (plain_steps + 1) == 0 else Decision("plain", 0)

    drafter = eng.executor.runner.spec_worker.drafter
    store = drafter.model.store_context

    def counted_store(*args):
        n["context_writes"] += 1
        return store(*args)

    eng.policy.decide = decide
    drafter.model.store_context = counted_store
    outs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    m = eng.spec_metrics
    assert (drafter.features is not None) == defer
    assert (eng.executor.runner.model.feature_cache is not None) == defer
    return [o.token_ids for o in outs], m.num_draft_tokens, m.num_accepted_tokens, n


@pytest.mark.parametrize("plain_steps", [2, 7])
def test_deferred_context_drafts_equal_writing_context_every_step(plain_128, plain_steps):
    prompts, want = plain_128
    prompts, want = prompts[2::5], [w[:40] for w in want[2::5]]
    tokens_d, drafts_d, accepted_d, n_d = _run(prompts, True, plain_steps)
    tokens_e, drafts_e, accepted_e, n_e = _run(prompts, False, plain_steps)
    assert tokens_d == tokens_e == want
    assert accepted_e > 0
    assert (drafts_d, accepted_d) == (drafts_e, accepted_e)
    # Plain steps wrote no context: only steps that verify or draft did (and none of the prompts' prefills,
    # which are plain too), ~2 of every plain_steps + 1 steps.
    assert n_d["context_writes"] <= n_e["context_writes"] * 2.5 / (plain_steps + 1), (n_d, n_e)


def test_a_sequence_never_drafted_for_writes_no_context():
    """With speculation off for the whole run (the policy picks plain), the drafter never projects anything
    and reserves none of its cache; output equals plain decoding."""
    eng = spec_engine(DFLASH, max_num_seqs=2)
    eng.policy.decide = lambda sched: Decision("plain", 0)
    drafter = eng.executor.runner.spec_worker.drafter
    calls = []
    store = drafter.model.store_context
    drafter.model.store_context = lambda *a: (calls.append(1), store(*a))[1]
    outs = eng.generate(
        ["The capital of France is", "def add(a, b):"], SamplingParams(max_tokens=12, temperature=0)
    )
    assert all(len(o.token_ids) == 12 for o in outs)
    assert calls == [] and not drafter.cache.tables
    assert len(drafter._pending_from) <= 2  # the last step's finished sequences are freed with the next step


@pytest.mark.gpu
def test_deferred_context_on_gpu_drafts_like_writing_it_every_step():
    """On the GPU the feature cache is written inside the decode / mixed-step CUDA graphs; in fp32 the drafts of
    the deferred context match writing it every step (batched projections may round a near-tie differently:
    the accepted counts may differ by a few), and the output is the target's either way."""
    prompts = RAW_PROMPTS
    outs, counts = [], []
    for defer in (True, False):
        eng = spec_engine(
            {**DFLASH, "defer_context": defer}, device="cuda", dtype="float32", max_num_seqs=8,
            speculation_profile_steps=0,
        )  # fmt: skip
        n = {"decisions": 0}

        def decide(sched, n=n):
            n["decisions"] += 1
            return Decision("decoupled", 4) if n["decisions"] % 4 == 0 else Decision("plain", 0)

        eng.policy.decide = decide
        outs.append(
            [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=48, temperature=0))]
        )
        counts.append((eng.spec_metrics.num_draft_tokens, eng.spec_metrics.num_accepted_tokens))
        assert (eng.executor.runner.model.feature_cache is not None) == defer
        del eng
    assert outs[0] == outs[1]
    (d0, a0), (d1, a1) = counts
    assert a1 > 0 and abs(a0 - a1) <= max(2, a1 // 50) and abs(d0 - d1) <= max(2, d1 // 50), counts


def test_long_deferred_stretch_is_written_in_bounded_context_steps(plain_128):
    """Whole prompts and a long plain stretch are projected in context steps of at most
    ``max_num_batched_tokens`` held rows (plus the step's own rows), with the same drafts as writing every step."""
    prompts, want = plain_128
    prompts, want = prompts[3::5], [w[:40] for w in want[3::5]]
    runs = []
    for defer in (True, False):
        eng = spec_engine({**DFLASH, "defer_context": defer}, max_num_seqs=4, max_num_batched_tokens=32)
        n = {"decisions": 0, "max_rows": 0}

        def decide(sched, n=n):
            n["decisions"] += 1
            return Decision("decoupled", 4) if n["decisions"] % 25 == 0 else Decision("plain", 0)

        drafter = eng.executor.runner.spec_worker.drafter
        store = drafter.model.store_context

        def counted(feats, *args, n=n, store=store):
            n["max_rows"] = max(n["max_rows"], feats.shape[0])
            return store(feats, *args)

        eng.policy.decide, drafter.model.store_context = decide, counted
        outs = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
        runs.append(([o.token_ids for o in outs], eng.spec_metrics.num_accepted_tokens, n["max_rows"]))
    (tok_d, acc_d, rows_d), (tok_e, acc_e, _) = runs
    assert tok_d == tok_e == want and acc_d == acc_e and acc_e > 0
    assert rows_d <= 32 + 4 * 5, rows_d  # held rows chunked by the token budget; the step adds S x (K + 1)


def test_held_features_follow_target_layer_ids_order_with_repeats():
    """``target_layer_ids`` may repeat or be unordered: features from the cache are regathered to that order."""
    from flexspec.spec.dflash import DFlashDrafter

    d = object.__new__(DFlashDrafter)
    d._capture, d._feature_index = (2, 5), [0, 0, 1]  # target_layer_ids [2, 2, 5]
    d.features = FeatureCache((2, 5), num_slots=3, hidden_size=2, dtype=torch.float32, device="cpu")
    d.features.store([torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0, 6.0]])], torch.tensor([1]))
    assert d._held_features(torch.tensor([1])).tolist() == [[1.0, 2.0, 1.0, 2.0, 5.0, 6.0]]


def test_no_feature_cache_where_plain_steps_are_never_launched():
    """Without async output processing every step goes through the worker: nothing is deferred, so no
    feature cache is allocated or charged against the KV budget."""
    eng = spec_engine(DFLASH, max_num_seqs=2, async_output_processing=False)
    drafter = eng.executor.runner.spec_worker.drafter
    assert not drafter.defer_context and drafter.features is None and drafter.kv_bytes_per_block() == 0
    assert eng.executor.runner.model.feature_cache is None
