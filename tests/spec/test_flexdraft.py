"""FlexDraft (issue 6): exact parallel / decoupled execution, group masks vs a brute-force dense reference,
checkpoint round trip, and the per-batch policy."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.engine.model_input import ModelInput
from flexspec.errors import ModelLoadError
from flexspec.spec.models.flexdraft_model import FlexDraftModel
from tests.conftest import plain_outputs, real_prompts

SPLIT, BLOCK = 26, 8


@pytest.fixture(scope="module")
def flexdraft_ckpt(engine, tmp_path_factory):
    """A FlexDraft checkpoint for the default model: tuned attention initialised from the target's, with
    noise so drafts differ from a copy of the target; calibration non-zero."""
    torch.manual_seed(0)
    model = FlexDraftModel.init_for_target(
        engine.executor.runner.model, SPLIT, BLOCK, calibration_hidden_size=64
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.float().std().clamp(min=1e-3))
    path = tmp_path_factory.mktemp("flexdraft")
    model.save_pretrained(path, dtype=torch.float32)
    return str(path)


def _spec(ckpt: str, execution: str, **kw) -> LLMEngine:
    sc = {
        "method": "flexdraft",
        "model": ckpt,
        "num_speculative_tokens": BLOCK - 1,
        "execution": execution,
        "verification_threshold": 0.0,
    }
    return LLMEngine(EngineConfig(device="cpu", max_model_len=512, speculative_config=sc, **kw))


@pytest.mark.parametrize("execution", ["parallel", "decoupled", "auto"])
def test_exact_at_t0_batch_1_and_5(engine, plain_128, flexdraft_ckpt, execution):
    """A noisy checkpoint (few drafts accepted: many groups per step); the shipped drafter's exactness on 21
    prompts x 128 tokens is in test_exact_all_methods. 5 prompts x 16 tokens: parallel steps are ~100x a plain
    step on a 2-core CPU."""
    prompts = real_prompts(engine, n_each=2)[:5]
    p = SamplingParams(max_tokens=16, temperature=0)
    ref = plain_outputs(plain_128, prompts, 16)
    eng = _spec(flexdraft_ckpt, execution)
    assert [o.token_ids for o in eng.generate(prompts, p)] == ref  # batch 5, mixed lengths
    assert eng.generate(prompts[:1], p)[0].token_ids == ref[0]  # batch 1
    assert eng.spec_metrics.num_drafts > 0
    if execution != "auto":
        assert set(eng.policy.mode_counts) == {execution}


def test_parallel_and_decoupled_draft_the_same_tokens(engine, flexdraft_ckpt):
    """Group min(a, g-1) of the parallel forward sees exactly what the decoupled forward sees afterwards."""
    prompts = real_prompts(engine, n_each=1)
    p = SamplingParams(max_tokens=24, temperature=0)
    par, dec = _spec(flexdraft_ckpt, "parallel"), _spec(flexdraft_ckpt, "decoupled")
    par.generate(prompts, p)
    dec.generate(prompts, p)
    assert par.spec_metrics.num_accepted_tokens_per_pos == dec.spec_metrics.num_accepted_tokens_per_pos
    assert par.spec_metrics.num_draft_tokens == dec.spec_metrics.num_draft_tokens


def test_group_attention_over_paged_cache_matches_dense_reference(engine, flexdraft_ckpt):
    """Brute force: mask tokens of groups placed after several anchors, computed through the paged KV cache
    (inference path), equal the dense computation with an explicit [context | groups] mask (training path)."""
    eng = _spec(flexdraft_ckpt, "decoupled")
    runner = eng.executor.runner
    drafter = runner.spec_worker.drafter
    ids = real_prompts(engine, n_each=1)[0][:40]
    T, bs = len(ids), eng.config.kv_block_size
    table = list(range(-(-T // bs)))
    runner.forward(
        ModelInput(
            ids, list(range(T)), [table[i // bs] * bs + i % bs for i in range(T)], [table], [0], [T], [T - 1]
        )
    )  # prefill: writes the target's K/V for all tuned layers
    anchors = [5, 17, 30, T - 1]
    n = len(anchors)
    side = drafter._side_stream(
        torch.tensor(anchors),
        torch.ones(n, dtype=torch.int32),
        torch.tensor([table] * n, dtype=torch.int32),
        n,
    )
    paged = runner.model.forward_side_only(side)  # [len(anchors) * B, H]
    dense = drafter.model.dense_side_hidden(runner.model, torch.tensor([ids]), torch.tensor([anchors]))[0]
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)


def test_checkpoint_round_trip_and_errors(engine, flexdraft_ckpt, tmp_path):
    target = engine.executor.runner.model
    m = FlexDraftModel.from_pretrained(flexdraft_ckpt, target)
    assert m.cfg.split_layer == SPLIT and m.cfg.tuned_layer_ids == list(range(SPLIT, target.spec.num_layers))
    m.save_pretrained(tmp_path / "a", dtype=torch.float32)
    m2 = FlexDraftModel.from_pretrained(tmp_path / "a", target)
    for (n1, t1), (n2, t2) in zip(m.checkpoint_state().items(), m2.checkpoint_state().items()):
        assert n1 == n2 and torch.equal(t1, t2)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    bad = dict(state)
    bad.pop(f"layers.{SPLIT}.self_attn.q_proj.weight")
    save_file(bad, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"layers.{SPLIT}.self_attn.q_proj.weight"):
        FlexDraftModel.from_pretrained(tmp_path / "a", target)
    bad = dict(state)
    bad["mask_embedding"] = torch.zeros(7)
    save_file(bad, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="mask_embedding"):
        FlexDraftModel.from_pretrained(tmp_path / "a", target)


def test_training_loss_decreases(engine):
    """A few AdamW steps on one batch lower the attention-tuning loss (the trainable part is wired)."""
    target = engine.executor.runner.model
    model = FlexDraftModel.init_for_target(target, 28, 4, calibration_hidden_size=32)
    ids = torch.tensor([real_prompts(engine, n_each=1)[0][:48]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    losses = []
    for step in range(4):
        loss, info = model.training_loss(
            target, ids, mask, num_anchors=4, generator=torch.Generator().manual_seed(0)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert info["acc_per_pos"].shape == (3,)
