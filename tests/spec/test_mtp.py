"""MTP: the target's own multi-token-prediction module in the DeepSeek-V3 and Qwen3-Next/3.5 layouts, on a
tiny random Llama target written by the test; a target without MTP weights fails clearly; exact at T=0
(issue 3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from configs import EngineConfig, SamplingParams
from configs.speculative import MTPConfig
from flexspec.engine.llm_engine import LLMEngine
from flexspec.errors import ModelLoadError
from flexspec.spec.models.mtp_model import find_mtp_layout
from flexspec.spec.mtp import MTPDrafter
from tests.spec.conftest import spec_engine
from tests.spec.test_dflash import DECOUPLED, assert_exact_with_oracle, reference
from tests.spec.test_eagle3 import check_chain_incremental

H, I, V, LAYERS = 64, 128, 49152, 2  # tiny target; the vocabulary is the default model's (its tokenizer)


@pytest.fixture(scope="module")
def tiny_target(engine, tmp_path_factory) -> Path:
    """A random 2-layer Llama as an HF folder (safetensors + the default model's tokenizer), no MTP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    src = Path(engine.executor.model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
    return folder


def mtp_tensors(layout: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Random MTP weights in ``layout`` + the config.json fields announcing them."""
    g = torch.Generator().manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    block = {
        "self_attn.q_proj.weight": w(64, H),
        "self_attn.k_proj.weight": w(32, H),
        "self_attn.v_proj.weight": w(32, H),
        "self_attn.o_proj.weight": w(H, 64),
        "mlp.gate_proj.weight": w(I, H),
        "mlp.up_proj.weight": w(I, H),
        "mlp.down_proj.weight": w(H, I),
        "input_layernorm.weight": torch.ones(H),
        "post_attention_layernorm.weight": torch.ones(H),
    }
    if layout == "deepseek":
        p = f"model.layers.{LAYERS}."
        extra = {"enorm.weight": torch.ones(H), "hnorm.weight": torch.ones(H), "eh_proj.weight": w(H, 2 * H),
                 "shared_head.norm.weight": torch.ones(H), "shared_head.head.weight": w(V, H)}  # fmt: skip
        return {p + k: t for k, t in {**block, **extra}.items()}, {"num_nextn_predict_layers": 1}
    extra = {"pre_fc_norm_embedding.weight": torch.ones(H), "pre_fc_norm_hidden.weight": torch.ones(H),
             "fc.weight": w(H, 2 * H), "norm.weight": torch.ones(H)}  # fmt: skip
    tensors = {"mtp." + k: t for k, t in extra.items()} | {"mtp.layers.0." + k: t for k, t in block.items()}
    return tensors, {"mtp_num_hidden_layers": 1}


def with_mtp(tiny_target: Path, dst: Path, layout: str, edit=None) -> Path:
    """A copy of the tiny target whose checkpoint also holds an MTP module (in a second safetensors file)."""
    shutil.copytree(tiny_target, dst)
    tensors, fields = mtp_tensors(layout)
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "mtp.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def test_target_without_mtp_weights_fails_at_load(engine, tiny_target):
    # the message starts with what the user named (the target here), not a cache path
    with pytest.raises(
        ModelLoadError, match="^method 'mtp': the target model 'smollm2-135m-instruct' has no MTP"
    ):
        MTPDrafter(MTPConfig(), engine.executor.runner)  # the default model
    with pytest.raises(ModelLoadError, match="no MTP weights"):
        find_mtp_layout(tiny_target, LAYERS)


@pytest.mark.parametrize(
    "layout, edit, needle",
    [
        (
            "deepseek",
            lambda t: t.pop(f"model.layers.{LAYERS}.self_attn.k_proj.weight"),
            "self_attn.k_proj.weight",
        ),
        (
            "deepseek",
            lambda t: t.pop(f"model.layers.{LAYERS}.hnorm.weight"),
            f"model.layers.{LAYERS}.hnorm.weight",
        ),
        ("qwen", lambda t: t.update({"mtp.fc.weight": torch.zeros(H, H)}), "mtp.fc.weight"),
        ("qwen", lambda t: t.update({"mtp.layers.0.mlp.bias": torch.zeros(H)}), "mtp.layers.0.mlp.bias"),
    ],
    ids=["ds-missing-block", "ds-missing-norm", "qwen-shape", "qwen-unexpected"],
)
def test_bad_mtp_weights_name_the_tensor(engine, tiny_target, tmp_path, layout, edit, needle):
    folder = with_mtp(tiny_target, tmp_path / "t", layout, edit)
    runner = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, device="cpu")).executor.runner
    with pytest.raises(ModelLoadError, match=needle.replace(".", r"\.")):
        MTPDrafter(MTPConfig(), runner)


@pytest.mark.parametrize("layout", ["deepseek", "qwen"])
def test_mtp_layouts_draft_incrementally_and_exactly(engine, tiny_target, tmp_path, layout, plain_128):
    folder = with_mtp(tiny_target, tmp_path / "t", layout)
    assert find_mtp_layout(folder, LAYERS).kind == layout
    plain = LLMEngine(EngineConfig(model=str(folder), max_model_len=512, device="cpu"))  # MTP tensors skipped
    prompts = reference(engine, plain_128)[0]
    ref = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=32, temperature=0))]

    drafter = MTPDrafter(MTPConfig(num_speculative_tokens=3), plain.executor.runner)
    assert drafter.capture_layers == (LAYERS - 1,) and (drafter.net.head is not None) == (
        layout == "deepseek"
    )
    check_chain_incremental(drafter, V, H)

    eng = spec_engine(
        {"method": "mtp", "num_speculative_tokens": 3, **DECOUPLED}, model=str(folder), max_model_len=512
    )
    assert_exact_with_oracle(eng, prompts, ref)
