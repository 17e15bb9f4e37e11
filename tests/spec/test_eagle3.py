"""EAGLE-3: checkpoint round trip (own layout and the release's ``LlamaForCausalLMEagle3`` with a draft
vocabulary), clear load errors, incremental drafting == drafting from scratch, exact at T=0 (issue 3).

``check_chain_incremental`` is shared with the MTP tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.speculative import Eagle3Config
from flexspec.errors import ModelLoadError
from flexspec.spec.eagle3 import Eagle3Drafter
from flexspec.spec.models.eagle3_model import Eagle3DraftConfig, Eagle3DraftModel
from tests.spec.conftest import spec_engine
from tests.spec.test_dflash import DECOUPLED, assert_exact_with_oracle, reference, run_drafter


def check_chain_incremental(drafter, vocab_size: int, hidden_size: int) -> None:
    """Feature-chain drafters (EAGLE-3, MTP): a prompt fed in two chunks, then a step that commits two
    accepted drafts + bonus, gives the same draft logits as a fresh sequence fed the whole history at once."""
    drafter.allocate(64)
    seen: list[torch.Tensor] = []
    logits = drafter.logits
    drafter.logits = lambda h: seen.append(logits(h)) or seen[-1]
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, vocab_size, (36,), generator=g).tolist()
    feats = [torch.randn(36, hidden_size, generator=g) * 3 for _ in drafter.capture_layers]

    once = run_drafter(drafter, [(1, toks[:30], range(29), True, 3)], feats)
    once_logits = torch.cat(seen)
    seen.clear()
    assert run_drafter(drafter, [(2, toks[:12], range(12), False, 0)], feats) == [[]]  # chunk: no drafts
    chunked = run_drafter(drafter, [(2, toks[:30], range(12, 29), True, 3)], feats)
    assert chunked == once and len(once[0]) == 3
    torch.testing.assert_close(torch.cat(seen), once_logits, atol=1e-4, rtol=1e-4)
    seen.clear()
    # seq 2 commits positions 29..31 (2 accepted drafts + the bonus's predecessor); seq 4 gets all 32 at once
    both = run_drafter(
        drafter, [(2, toks[:33], range(29, 32), True, 3), (4, toks[:33], range(32), True, 3)], feats
    )
    assert both[0] == both[1]
    for step in seen:  # context step + 2 draft steps, rows [seq 2, seq 4]
        torch.testing.assert_close(step[0], step[1], atol=1e-4, rtol=1e-4)
    assert (seen[0][0] - once_logits[0]).abs().max() > 1e-2  # drafts depend on the features
    drafter.free([1, 2, 4])
    assert not drafter.cache.tables and not drafter.seqs


@pytest.fixture(scope="module")
def eagle_dir(engine, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = Eagle3DraftModel(Eagle3DraftConfig.for_target(engine.spec, intermediate_size=256))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    folder = tmp_path_factory.mktemp("eagle3")
    model.save_pretrained(folder)
    return folder


def test_checkpoint_layout_and_round_trip(engine, eagle_dir, tmp_path):
    cfg = json.loads((eagle_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["eagle_config"]["target_layer_ids"] == [2, 15, 27]  # low / mid / high of 30 layers
    names = set(load_file(eagle_dir / "model.safetensors"))
    assert {
        "fc.weight",
        "norm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
    } <= names
    assert not any(n.startswith(("lm_head", "embed_tokens")) for n in names)  # the target's are shared
    a = Eagle3DraftModel.from_pretrained(eagle_dir, engine.spec)
    assert a.midlayer.self_attn.q_proj.weight.shape == (576, 2 * 576)
    a.save_pretrained(tmp_path)
    b = Eagle3DraftModel.from_pretrained(tmp_path, engine.spec)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda s, c: s.pop("midlayer.self_attn.v_proj.weight"), "midlayer.self_attn.v_proj.weight"),
        (lambda s, c: s.update({"fc.weight": torch.zeros(576, 576)}), "fc.weight"),
        (lambda s, c: c["eagle_config"].update(target_layer_ids=[2, 15]), "eagle_config.target_layer_ids"),
        (
            lambda s, c: c["eagle_config"].update(target_layer_ids=[2, 15, 40]),
            "eagle_config.target_layer_ids",
        ),
        (lambda s, c: c.update(vocab_size=32000), "vocab_size"),
        (lambda s, c: c.update(num_hidden_layers=2), "num_hidden_layers"),
    ],
    ids=["missing", "shape", "two-layers-ids", "layer-range", "vocab", "depth"],
)
def test_bad_checkpoint_names_the_culprit(engine, eagle_dir, tmp_path, edit, needle):
    state = load_file(eagle_dir / "model.safetensors")
    cfg = json.loads((eagle_dir / "config.json").read_text())
    edit(state, cfg)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
        Eagle3DraftModel.from_pretrained(tmp_path, engine.spec)


def test_release_layout_with_reduced_draft_vocab(engine, eagle_dir, tmp_path):
    """Release layout: ``LlamaForCausalLMEagle3``, ``eagle_aux_hidden_state_layer_ids``, lm_head over a draft
    vocabulary + d2t."""
    state = load_file(eagle_dir / "model.safetensors")
    cfg = json.loads((eagle_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [3, 14, 26]}
    cfg["draft_vocab_size"] = 8
    draft_to_target = torch.tensor([5, 17, 99, 100, 2000, 3000, 40000, 49151])
    state["lm_head.weight"] = torch.randn(8, 576)
    state["d2t"] = draft_to_target - torch.arange(8)
    state["t2d"] = torch.zeros(49152, dtype=torch.bool)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = Eagle3DraftModel.from_pretrained(tmp_path, engine.spec)
    assert model.target_layer_ids == [3, 14, 26]
    h = torch.randn(5, 576)
    full = model.compute_logits(h, engine.executor.runner.model.lm_head)  # [5, 49152]
    assert full.shape == (5, 49152)
    assert torch.equal(full.argmax(-1), draft_to_target[model.lm_head(h).argmax(-1)])


def test_incremental_drafting_matches_from_scratch(engine, eagle_dir):
    runner = engine.executor.runner
    drafter = Eagle3Drafter(Eagle3Config(model=str(eagle_dir), num_speculative_tokens=3), runner)
    assert drafter.capture_layers == (2, 15, 27)
    check_chain_incremental(drafter, runner.spec.vocab_size, runner.spec.hidden_size)


def test_exact_with_accepted_runs_in_a_mixed_batch(engine, eagle_dir, plain_128):
    prompts, ref = reference(engine, plain_128)
    eng = spec_engine(
        {"method": "eagle3", "model": str(eagle_dir), "num_speculative_tokens": 3, **DECOUPLED},
        max_model_len=512,
    )
    assert_exact_with_oracle(eng, prompts, ref)
