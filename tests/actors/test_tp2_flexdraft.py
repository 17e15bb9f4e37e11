"""FlexDraft under TP=2 (gloo, one TPWorker per CPU slot): the tuned attention is TP-sharded like the target,
and every rank drafts from the same broadcast decision; T=0 tokens equal the plain TP=1 engine's.

Its own module so the TP=2 ngram engine of test_ray_executor.py (module-scoped, 2 CPUs) is gone first.
"""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from tests.conftest import DEFAULT_MODEL, real_prompts

MAX_TOKENS = 24
BLOCK = 4  # drafts per step = BLOCK - 1


@pytest.fixture(scope="module")
def flexdraft_ckpt(engine, tmp_path_factory):
    """A fresh FlexDraft checkpoint for the default model (tuned attention copied from the target's)."""
    from flexspec.spec.models.flexdraft_model import FlexDraftModel

    path = tmp_path_factory.mktemp("flexdraft-tp2")
    model = FlexDraftModel.init_for_target(
        engine.executor.runner.model, split_layer=28, block_size=BLOCK, calibration_hidden_size=32
    )
    model.save_pretrained(path, dtype=torch.float32)
    return str(path)


@pytest.fixture(scope="module")
def tp2_flexdraft_engine(ray_session, flexdraft_ckpt):
    from actors import RayExecutor
    from flexspec.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=DEFAULT_MODEL,
        device="cpu",
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        tensor_parallel_size=2,
        speculative_config={
            "method": "flexdraft",
            "model": flexdraft_ckpt,
            "num_speculative_tokens": BLOCK - 1,
            "verification_threshold": 0.0,  # verify every draft: the check is on drafting, not on selection
        },
    )
    engine = LLMEngine(cfg, executor=RayExecutor(cfg, execute_timeout_s=120))
    yield engine
    engine.shutdown()


def test_tp2_flexdraft_matches_tp1_greedy(tp2_flexdraft_engine, engine):
    prompts = real_prompts(engine, n_each=1)  # GSM8K + MT-Bench (chat template) and HumanEval (raw code)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = engine.generate(prompts, params)
    got = tp2_flexdraft_engine.generate(prompts, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids, (w.text, g.text)
    modes = tp2_flexdraft_engine.policy.mode_counts
    assert modes.get("decoupled", 0) + modes.get("parallel", 0) > 0, modes
    assert tp2_flexdraft_engine.spec_metrics.num_drafts > 0, tp2_flexdraft_engine.spec_metrics.as_dict()
    assert tp2_flexdraft_engine.block_manager.usage == 0.0
