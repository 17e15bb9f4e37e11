"""DSpark: the Markov head changes drafts (sequentially, from the previous draft), the confidence head cuts
verification, the checkpoint round-trips with clear errors, exact at T=0 (issue 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.speculative import DSparkConfig
from flexspec.errors import ModelLoadError
from flexspec.spec.dspark import DSparkDrafter, verification_length
from flexspec.spec.models.dspark_model import DSparkDraftConfig, DSparkDraftModel
from tests.spec.conftest import spec_engine
from tests.spec.test_dflash import DECOUPLED, assert_exact_with_oracle, reference, run_drafter


@pytest.fixture(scope="module")
def dspark_dir(engine, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = DSparkDraftConfig.for_target(
        engine.spec, num_hidden_layers=1, block_size=4, target_layer_ids=[1, 14, 27], intermediate_size=256,
        markov_rank=16,
    )  # fmt: skip
    model = DSparkDraftModel(cfg)
    model.reset_parameters(std=0.05)
    folder = tmp_path_factory.mktemp("dspark")
    model.save_pretrained(folder)
    return folder


def test_markov_head_is_applied_sequentially_from_the_anchor():
    torch.manual_seed(0)
    cfg = DSparkDraftConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, block_size=5, mask_token_id=0, target_layer_ids=[0], vocab_size=40,
        markov_rank=4, max_position_embeddings=32,
    )  # fmt: skip
    model = DSparkDraftModel(cfg)
    logits, anchors = torch.randn(3, 4, 40), torch.tensor([1, 7, 30])
    with torch.no_grad():
        model.markov.w2.weight.zero_()
        assert torch.equal(model.select(logits, anchors), logits.argmax(-1))  # no bias: plain argmax
        model.markov.w2.weight.normal_(0.0, 10.0)
        drafts = model.select(logits, anchors)
    assert not torch.equal(drafts, logits.argmax(-1))
    prev = anchors
    for i in range(4):  # position i is biased by the draft at i-1 (the anchor for i = 0)
        prev = (logits[:, i] + model.markov_logits(prev)).argmax(-1)
        assert torch.equal(drafts[:, i], prev)


def test_verification_length_stops_after_first_unconfident_draft():
    assert verification_length([0.9, 0.4, 0.8], 0.5) == 2
    assert verification_length([0.9, 0.6, 0.8], 0.5) == 3
    assert verification_length([0.1, 0.9], 0.5) == 1
    assert verification_length([0.1, 0.2], 0.0) == 2


def test_checkpoint_layout_round_trip_and_errors(engine, dspark_dir, tmp_path):
    cfg = json.loads((dspark_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["dspark_config"] == {"markov_rank": 16}
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 14, 27]
    state = load_file(dspark_dir / "model.safetensors")
    assert tuple(state["markov.w1.weight"].shape) == (49152, 16) and tuple(
        state["markov.w2.weight"].shape
    ) == (49152, 16)
    assert tuple(state["confidence.weight"].shape) == (1, 576) and tuple(state["confidence.bias"].shape) == (
        1,
    )
    a = DSparkDraftModel.from_pretrained(dspark_dir, engine.spec)
    a.save_pretrained(tmp_path / "again")
    b = DSparkDraftModel.from_pretrained(tmp_path / "again", engine.spec)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    state.pop("markov.w2.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"markov\.w2\.weight"):
        DSparkDraftModel.from_pretrained(tmp_path, engine.spec)
    cfg.pop("dspark_config")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"dspark_config\.markov_rank"):
        DSparkDraftModel.from_pretrained(tmp_path, engine.spec)


def test_drafter_markov_and_confidence_shape_the_proposal(engine, dspark_dir):
    runner = engine.executor.runner
    drafter = DSparkDrafter(DSparkConfig(model=str(dspark_dir), confidence_threshold=0.0), runner)
    drafter.allocate(32)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, runner.spec.vocab_size, (30,), generator=g).tolist()
    feats = [torch.randn(30, runner.spec.hidden_size, generator=g) for _ in drafter.capture_layers]

    def drafts(sid: int) -> list[int]:
        return run_drafter(drafter, [(sid, toks, range(29), True, 3)], feats)[0]

    with torch.no_grad():
        drafter.model.confidence.weight.zero_()
        drafter.model.confidence.bias.zero_()  # confidence 0.5 everywhere
        drafter.model.markov.w2.weight.zero_()
        plain = drafts(1)
        drafter.model.markov.w1.weight.normal_(0.0, 1.0)
        drafter.model.markov.w2.weight.normal_(0.0, 1.0)
        biased = drafts(2)
    assert len(plain) == len(biased) == 3 and plain != biased
    drafter.config = drafter.config.model_copy(update={"confidence_threshold": 0.6})
    assert drafts(3) == biased[:1]  # every draft below 0.6: verify only the first
    drafter.config = drafter.config.model_copy(update={"confidence_threshold": 0.4})
    assert drafts(4) == biased


def test_exact_with_accepted_runs_in_a_mixed_batch(engine, dspark_dir, plain_128):
    prompts, ref = reference(engine, plain_128)
    eng = spec_engine(
        {"method": "dspark", "model": str(dspark_dir), "confidence_threshold": 0.5, **DECOUPLED},
        max_model_len=512,
    )
    assert_exact_with_oracle(eng, prompts, ref)
    m = eng.spec_metrics
    assert m.num_draft_tokens < 3 * m.num_drafts  # the confidence head cut some proposals
