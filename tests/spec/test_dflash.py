"""DFlash: the published checkpoint layout round-trips, bad checkpoints fail naming the tensor / field, the
cached context path equals the dense training forward, and speculation is exact at T=0 (issue 3).

Helpers here (``reference``, ``run_drafter``, ``assert_exact_with_oracle``) are shared by the DSpark, EAGLE-3
and MTP tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs import SamplingParams
from configs.speculative import DFlashConfig
from flexspec.errors import ModelLoadError
from flexspec.spec.base import SeqDraftInput
from flexspec.spec.dflash import DFlashDrafter
from flexspec.spec.models.dflash_model import (
    DFlashDraftConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    train_attention_mask,
)
from tests.conftest import plain_outputs, real_prompts
from tests.spec.conftest import histories_after, on_worker_outputs, spec_engine

MAX_TOKENS = 32
DECOUPLED = {"execution": "decoupled"}  # draft every step (the auto policy may switch random drafters off)
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


# ---- shared helpers ----------------------------------------------------------------------------------------
def reference(engine, plain_128) -> tuple[list[list[int]], list[list[int]]]:
    """Four real prompts of mixed lengths (GSM8K, HumanEval x2, MT-Bench) and their plain greedy outputs."""
    prompts = [real_prompts(engine, n_each=2)[i] for i in (0, 2, 3, 4)]
    return prompts, plain_outputs(plain_128, prompts, MAX_TOKENS)


def assert_exact_with_oracle(eng, prompts: list[list[int]], ref: list[list[int]]) -> None:
    """Generate with the drafter's proposals partly replaced by the true continuation (0..k correct leading
    drafts, varying per step, the rest the drafter's own), so that accepted runs of every length, rejections
    at every position and the drafter's multi-row context updates all occur; output must equal ``ref``.
    The drafts are replaced where the worker hands them to the engine, so this covers the general path
    (verify, then ``propose``) and the device-side one (``propose_on_device``) alike."""
    worker = eng.executor.runner.spec_worker
    truth = [list(p) + list(r) for p, r in zip(prompts, ref)]

    def oracle(inp, out) -> None:
        if not out.draft_token_ids:
            return
        hists = histories_after(worker, inp, out)
        for hist, drafts in zip(hists.values(), out.draft_token_ids):
            seq = next((t for t in truth if t[: len(hist)] == hist), None)
            if drafts and seq is not None:
                keep = len(hist) % (len(drafts) + 1)
                drafts[:keep] = seq[len(hist) : len(hist) + keep]

    with on_worker_outputs(worker, oracle):
        outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == ref
    m = eng.spec_metrics
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0, m.as_dict()


def run_drafter(drafter, steps: list[tuple], feats: list[torch.Tensor]) -> list[list[int]]:
    """One ``propose`` call. ``steps``: (seq_id, token_ids, committed positions, emitted, num_drafts) per
    sequence; the captured rows are ``feats[j][positions]`` (per capture layer j), packed in order."""
    batch, rows = [], []
    for sid, toks, positions, emitted, k in steps:
        batch.append(
            SeqDraftInput(
                seq_id=sid, token_ids=list(toks), num_new_committed=len(positions),
                hidden_rows=list(range(len(rows), len(rows) + len(positions))), num_drafts=k, temperature=0.0,
                seed=0, emitted=emitted,
            )
        )  # fmt: skip
        rows.extend(positions)
    idx = torch.tensor(rows, dtype=torch.long)
    return drafter.propose(batch, [f.index_select(0, idx) for f in feats]).token_ids


def tiny_dflash_config(spec, **overrides) -> DFlashDraftConfig:
    args = {
        "num_hidden_layers": 1,
        "block_size": 4,
        "target_layer_ids": [1, 14, 27],
        "intermediate_size": 256,
    }
    args.update(overrides)
    return DFlashDraftConfig.for_target(spec, **args)


# ---- checkpoint --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash_dir(engine, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = DFlashDraftModel(tiny_dflash_config(engine.spec))
    model.reset_parameters(std=0.05)
    folder = tmp_path_factory.mktemp("dflash")
    model.save_pretrained(folder)
    return folder


def test_checkpoint_has_the_published_layout(dflash_dir):
    cfg = json.loads((dflash_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": 49151, "target_layer_ids": [1, 14, 27]}
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert field in cfg
    for field in ("head_dim", "intermediate_size", "rms_norm_eps", "rope_theta"):
        assert field in cfg
    names = set(load_file(dflash_dir / "model.safetensors"))
    layer = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"layers.0.{name}.weight"
        for name in ("self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm")
    }  # fmt: skip
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight"} | layer
    assert tuple(load_file(dflash_dir / "model.safetensors")["fc.weight"].shape) == (576, 3 * 576)


def test_round_trip_is_identical(engine, dflash_dir, tmp_path):
    a = DFlashDraftModel.from_pretrained(dflash_dir, engine.spec)
    a.save_pretrained(tmp_path)
    b = DFlashDraftModel.from_pretrained(tmp_path, engine.spec)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (dflash_dir / "config.json").read_text()
    )
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _broken_copy(src: Path, dst: Path, tensors=None, config=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if tensors:
        tensors(state)
    if config:
        config(cfg)
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "tensors, config, needle",
    [
        (lambda s: s.pop("layers.0.self_attn.k_proj.weight"), None, "layers.0.self_attn.k_proj.weight"),
        (lambda s: s.update({"fc.weight": s["fc.weight"][:, :576].contiguous()}), None, "fc.weight"),
        (
            lambda s: s.update({"layers.0.mlp.up_proj.weight": torch.zeros(255, 576)}),
            None,
            "layers.0.mlp.up_proj",
        ),
        (lambda s: s.update({"lm_head.weight": torch.zeros(4, 576)}), None, "lm_head.weight"),
        (None, lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
        (None, lambda c: c["dflash_config"].update(mask_token_id=10**6), "dflash_config.mask_token_id"),
        (None, lambda c: c["dflash_config"].update(target_layer_ids=[1, 14, 99]), "target_layer_ids"),
        (None, lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (None, lambda c: c.update(block_size="16"), "block_size"),
        (None, lambda c: c.update(hidden_size=512), "hidden_size"),
    ],
    ids=[
        "missing",
        "fc-shape",
        "mlp-shape",
        "unexpected",
        "no-mask-id",
        "mask-id-range",
        "layer-range",
        "arch",
        "block-type",
        "hidden-size",
    ],
)
def test_bad_checkpoint_names_the_culprit(engine, dflash_dir, tmp_path, tensors, config, needle):
    bad = _broken_copy(dflash_dir, tmp_path / "bad", tensors, config)
    with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
        DFlashDraftModel.from_pretrained(bad, engine.spec)


def test_default_target_layer_ids_spread_from_1_to_l_minus_3():
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-8B-DFlash-b16
    assert default_target_layer_ids(30, 1) == [15]


def test_logits_stay_in_the_heads_dtype_only_without_multiplier_or_cap(engine):
    """``compute_logits(upcast=False)`` (the captured greedy step, which upcasts in ``top1_softmax``) returns the
    LM head's bf16 output as is, but a checkpoint's multiplier / soft cap still apply in fp32."""
    head = torch.nn.Linear(8, 32, bias=False).to(torch.bfloat16)
    h = torch.randn(3, 8).to(torch.bfloat16)
    raw = DFlashDraftModel(tiny_dflash_config(engine.spec)).compute_logits(h, head, upcast=False)
    assert raw.dtype == torch.bfloat16 and torch.equal(raw, head(h))
    capped = DFlashDraftModel(
        tiny_dflash_config(engine.spec, output_multiplier=2.0, final_logit_softcapping=0.5)
    )
    got = capped.compute_logits(h, head, upcast=False)
    assert got.dtype == torch.float32 and torch.equal(got, capped.compute_logits(h, head))
    assert torch.allclose(got, torch.tanh(head(h).float() * 2.0 / 0.5) * 0.5)


# ---- numerics ----------------------------------------------------------------------------------------------
def test_cached_context_matches_dense_training_forward(engine, dflash_dir):
    runner = engine.executor.runner
    drafter = DFlashDrafter(DFlashConfig(model=str(dflash_dir), num_speculative_tokens=3), runner)
    drafter.allocate(64)
    seen: list[torch.Tensor] = []
    select = drafter._select
    drafter._select = lambda items, hidden, logits: (
        seen.append(logits.clone()) or select(items, hidden, logits)
    )
    g = torch.Generator().manual_seed(0)
    L, H, B = 40, runner.spec.hidden_size, drafter.block_size
    toks = torch.randint(0, runner.spec.vocab_size, (L,), generator=g).tolist()
    feats = [torch.randn(L, H, generator=g) * 3 for _ in drafter.capture_layers]

    # seq 1: prompt in two chunks (the first emits nothing); seq 2: at once, batched with a shorter seq 3
    assert run_drafter(drafter, [(1, toks[:16], range(16), False, 0)], feats) == [[]]
    chunked = run_drafter(drafter, [(1, toks, range(16, L - 1), True, 3)], feats)
    once = run_drafter(drafter, [(3, toks[:25], range(24), True, 2), (2, toks, range(L - 1), True, 3)], feats)
    assert chunked[0] == once[1] and len(once[0]) == 2

    model = drafter.model
    ctx = torch.cat([feats[j][: L - 1] for j in drafter._feature_index], dim=-1)[None]  # [1, L-1, 3H]
    block = runner.model.embed_tokens(torch.tensor([toks[-1]] + [model.mask_token_id] * (B - 1)))[None]
    pos = torch.arange(L - 1, L - 1 + B)[None]
    with torch.no_grad():
        dense = model.compute_logits(model.forward_train(ctx, block, pos)[0, 1:], runner.model.lm_head)
        other = model.compute_logits(
            model.forward_train(ctx.flip(1), block, pos)[0, 1:], runner.model.lm_head
        )
    torch.testing.assert_close(seen[0][0], dense, atol=1e-4, rtol=1e-4)  # chunked cache == dense
    torch.testing.assert_close(seen[1][1], dense, atol=1e-4, rtol=1e-4)  # batched, varlen == dense
    assert (other - dense).abs().max() > 1e-2  # the drafts do depend on the context
    assert chunked[0] == dense.argmax(-1).tolist()
    free = len(drafter.cache.free_blocks)
    drafter.free([1, 2, 3])
    assert not drafter.cache.tables and len(drafter.cache.free_blocks) > free


def test_forward_train_masks_blocks_and_trains():
    torch.manual_seed(0)
    cfg = DFlashDraftConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, block_size=4, mask_token_id=0, target_layer_ids=[0, 1], vocab_size=50,
        max_position_embeddings=64,
    )  # fmt: skip
    model = DFlashDraftModel(cfg)
    T, anchors = 12, torch.tensor([[3, 8]])
    mask = train_attention_mask(T, anchors, cfg.block_size)  # [1, 8, 20]
    assert mask.shape == (1, 8, 20)
    assert (
        mask[0, 0, :3].all()
        and not mask[0, 0, 3:T].any()
        and mask[0, 0, T : T + 4].all()
        and not mask[0, 0, T + 4 :].any()
    )
    feats = torch.randn(1, T, 64, requires_grad=False)
    emb = torch.randn(1, 8, 32)
    pos = torch.cat([torch.arange(3, 7), torch.arange(8, 12)])[None]
    h = model.forward_train(feats, emb, pos, attention_mask=mask)
    head = torch.nn.Linear(32, 50, bias=False)
    loss = torch.nn.functional.cross_entropy(model.compute_logits(h[0], head), torch.randint(0, 50, (8,)))
    loss.backward()
    assert model.fc.weight.grad is not None and model.layers[0].self_attn.k_norm.weight.grad is not None
    # block 1's outputs do not depend on context it must not see (positions >= its anchor 3)
    feats2 = feats.clone()
    feats2[0, 3:] += 1.0
    h2 = model.forward_train(feats2, emb, pos, attention_mask=mask)
    torch.testing.assert_close(h[0, :4], h2[0, :4])
    assert not torch.allclose(h[0, 4:], h2[0, 4:])


# ---- engine ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dflash_engine(dflash_dir):
    return spec_engine({"method": "dflash", "model": str(dflash_dir), **DECOUPLED}, max_model_len=512)


@pytest.mark.parametrize("device_verification", [True, False], ids=["device-side", "general"])
def test_loaded_checkpoint_is_exact_with_accepted_runs_in_a_mixed_batch(
    engine, plain_128, dflash_engine, device_verification
):
    prompts, ref = reference(engine, plain_128)
    worker = dflash_engine.executor.runner.spec_worker
    drafter = worker.drafter
    assert drafter.num_speculative_tokens == 3  # block_size - 1 caps the config's default 15
    assert drafter.capture_layers == (1, 14, 27) and drafter.memory_bytes() > 0
    worker.device_verification = device_verification
    on_device = worker._launch_on_device
    calls = []
    worker._launch_on_device = lambda *a: calls.append(1) or on_device(*a)
    try:
        assert_exact_with_oracle(dflash_engine, prompts, ref)
    finally:
        worker.device_verification = True
        del worker._launch_on_device
    assert bool(calls) == device_verification  # the path under test is the one that ran


def test_sampling_with_deterministic_drafts_is_reproducible(engine, dflash_engine):
    prompts = [real_prompts(engine, n_each=2)[4]]  # the shortest prompt
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    a = [o.token_ids for o in dflash_engine.generate(prompts, params)]
    b = [o.token_ids for o in dflash_engine.generate(prompts, params)]
    assert a == b and all(a)
