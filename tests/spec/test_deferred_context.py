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
from tests.spec.conftest import spec_engine

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
    prompts = [
        "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in all?",
        "def fibonacci(n):",
        "Write a short poem about the sea.",
        "Explain in two sentences why the sky is blue.",
        "List three prime numbers greater than 50 and explain how you checked them.",
    ]
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
