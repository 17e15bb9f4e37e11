"""The decoder's skinny path (``LlamaDecoderLayer.forward_skinny``: steps of <= 16 tokens through fused
norm+GEMM / GEMM+residual / GEMM+activation ops, the residual stream updated in place) gives the same tokens
as the unfused layers: plain decoding, DFlash (whose verification steps capture target layers) and on a GPU."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.layers import fused
from flexspec.models.llama import LlamaAttention, LlamaDecoderLayer
from tests.conftest import DEFAULT_MODEL, plain_outputs, real_prompts
from tests.spec.conftest import spec_engine


@pytest.fixture
def skinny_calls(monkeypatch):
    """Counts the layer calls that take the skinny path; returns the counter."""
    calls = {"n": 0, "rows": set()}
    layer_fn = LlamaDecoderLayer.forward_skinny

    def counted(self, h, meta, capture=None):
        calls["n"] += 1
        calls["rows"].add(h.shape[0])
        return layer_fn(self, h, meta, capture)

    monkeypatch.setattr(LlamaDecoderLayer, "forward_skinny", counted)
    return calls


@pytest.fixture(scope="module")
def case(engine, plain_128):
    prompts = real_prompts(engine, n_each=2)
    params = SamplingParams(max_tokens=20, temperature=0)
    return prompts, params, plain_outputs(plain_128, prompts, 20)


def test_plain_decode_through_skinny_path_is_exact(engine, case, skinny_calls, monkeypatch):
    prompts, params, want = case
    monkeypatch.setattr(fused, "SKINNY", "torch")  # the torch reference of the fused ops, on CPU
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    # 6 sequences decode together (6 rows), then fewer as they finish; 30 layers per step
    assert skinny_calls["n"] >= 30 * 19 and 6 in skinny_calls["rows"], skinny_calls


def test_decode_fusions_at_batch_one_are_exact(engine, case, monkeypatch):
    """Batch-1 decode takes ``LlamaAttention.attend_decode`` (norm + QKV + RoPE + cache write in one op, the O
    projection merging split-KV states): through their torch references on CPU, the same tokens as the plain
    engine, and the same with the fusions turned off."""
    prompts, params, want = case
    calls = {"n": 0}
    fn = LlamaAttention.attend_decode

    def counted(self, x, meta, norm):
        calls["n"] += 1
        assert x.shape[0] <= 2
        return fn(self, x, meta, norm)

    monkeypatch.setattr(LlamaAttention, "attend_decode", counted)
    monkeypatch.setattr(fused, "SKINNY", "torch")
    for on in (True, False):
        monkeypatch.setattr(fused, "DECODE_FUSIONS", on)
        calls["n"] = 0
        got = [engine.generate([p], params)[0].token_ids for p in prompts[:2]]
        assert got == want[:2]
        assert (calls["n"] >= 30 * 19) if on else calls["n"] == 0, calls


def test_dflash_verification_through_skinny_path_is_exact(case, skinny_calls, monkeypatch):
    """Verification steps of 2 x 5 tokens capture DFlash's target layers from the in-place residual stream:
    the same outputs, drafts and acceptances as through the unfused layers."""
    prompts, _, _ = case
    prompts = prompts[:4]
    params = SamplingParams(max_tokens=12, temperature=0)
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4,
            "execution": "decoupled"}  # fmt: skip
    runs = []
    for mode in ("off", "torch"):
        monkeypatch.setattr(fused, "SKINNY", mode)
        eng = spec_engine(spec, max_num_seqs=2)
        outs = [o.token_ids for o in eng.generate(prompts, params)]
        runs.append((outs, eng.spec_metrics.num_draft_tokens, eng.spec_metrics.num_accepted_tokens))
    assert runs[0] == runs[1] and runs[0][2] > 0
    assert 10 in skinny_calls["rows"], skinny_calls


def test_skinny_path_only_where_it_applies(monkeypatch):
    """Off by default on CPU, never for more than 16 rows (nor 0), never while gradients are enabled (a model
    whose layers train behind a frozen embedding: x needs no gradient, the weights do)."""
    x = torch.zeros(4, 8)
    with torch.no_grad():
        assert not fused.use_skinny(x)  # "auto" on CPU
        monkeypatch.setattr(fused, "SKINNY", "torch")
        assert fused.use_skinny(x) and not fused.use_skinny(torch.zeros(17, 8))
        assert not fused.use_skinny(torch.zeros(0, 8))
    assert not fused.use_skinny(x)  # gradients enabled
    monkeypatch.setattr(fused, "SKINNY", "off")
    with torch.no_grad():
        assert not fused.use_skinny(x)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_skinny_path_with_qkv_bias_and_qk_norms(engine, family, tmp_path, monkeypatch):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorms) through the fused data flow: the same greedy tokens as the
    unfused layers (fp32 CPU, the skinny-CPU matmul form off on both sides, since the torch reference of the
    fused GEMMs uses ``F.linear``: the two paths then compute the same sums)."""
    import shutil
    from pathlib import Path

    import transformers

    from flexspec.layers import linear

    torch.manual_seed(0)
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    cfg = cls(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, initializer_range=0.2)  # fmt: skip
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[family]
    m = model_cls(cfg)
    if family == "qwen2":
        with torch.no_grad():  # non-zero biases, so that dropping one shows
            for layer in m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    m.save_pretrained(tmp_path, safe_serialization=True)
    src = Path(engine.executor.model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp_path / name)
    monkeypatch.setattr(linear, "CPU_GEMM", "f_linear")  # F.linear everywhere
    prompts = [[1, 5, 9, 200, 31], [1, 77, 3], [1, 4000, 12, 12, 8, 9, 10]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    fused_calls = []
    attend_decode = LlamaAttention.attend_decode
    monkeypatch.setattr(
        LlamaAttention, "attend_decode", lambda self, *a: fused_calls.append(1) or attend_decode(self, *a)
    )
    runs = []
    # 3 sequences a step (the skinny GEMMs), then 1 (also the batch-1 decode fusions: QKV bias + RoPE + cache)
    for mode, seqs in (("off", 3), ("torch", 3), ("torch", 1)):
        monkeypatch.setattr(fused, "SKINNY", mode)
        eng = LLMEngine(EngineConfig(model=str(tmp_path), max_model_len=256, device="cpu", max_num_seqs=seqs))
        outs = eng.generate(prompts, params)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1] == runs[2]
    assert bool(fused_calls) == (family == "qwen2")  # Qwen3's q/k norms sit between QKV and RoPE: not fused


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skinny_path_on_gpu_matches_unfused_layers(case, dtype, skinny_calls, monkeypatch):
    """With the Triton kernels and CUDA graphs: fp32 gives the same tokens as the unfused layers; in bf16 (sums
    in another order, so a near-tie may flip a greedy choice) most sequences stay identical."""
    prompts, params, _ = case
    cfg = EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", dtype=dtype, max_num_seqs=8)
    outs = []
    for mode in ("off", "on"):  # "on", not "auto": the start-up measurement may choose no row count
        monkeypatch.setattr(fused, "SKINNY", mode)
        eng = LLMEngine(cfg)
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
        del eng
    assert skinny_calls["n"] > 0  # captured into the decode graphs at least
    if dtype == "float32":
        assert outs[0] == outs[1]
    else:
        same = sum(a == b for a, b in zip(*outs))
        assert same >= len(prompts) // 2, (same, outs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_fusions_on_gpu_match_their_own_launches(case, dtype, monkeypatch):
    """Batch-1 to batch-4 decode (3-4 with programmatic dependent launch) with RoPE + cache write inside the QKV
    GEMV and split-KV merge inside the O GEMV (``flexspec_kernels.skinny_attention``) vs the same kernels as launches
    of their own, in CUDA graphs."""
    prompts, params, _ = case
    cfg = EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", dtype=dtype, max_num_seqs=4)
    monkeypatch.setattr(fused, "SKINNY", "on")
    outs = []
    for on in (True, False):
        monkeypatch.setattr(fused, "DECODE_FUSIONS", on)
        eng = LLMEngine(cfg)
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
        del eng
    if dtype == "float32":
        assert outs[0] == outs[1]
    else:
        same = sum(a == b for a, b in zip(*outs))
        assert same >= len(prompts) // 2, (same, outs)


@pytest.mark.gpu
def test_pdl_on_gpu_gives_identical_tokens(case, monkeypatch):
    """The decode kernels launched with programmatic dependent launch (``flexspec_kernels.pdl``) vs without, in
    the engine's CUDA graphs at batch 1-8 (the gemv and tensor-core forms, attention, argmax): PDL only changes
    when a launch starts, so even bf16 gives the same tokens."""
    from flexspec_kernels import pdl

    if not pdl._device_supports(torch.cuda.current_device()):
        pytest.skip("needs an sm_90+ CUDA GPU")
    prompts, params, _ = case
    cfg = EngineConfig(
        model=DEFAULT_MODEL, max_model_len=1024, device="cuda", dtype="bfloat16", max_num_seqs=8
    )
    monkeypatch.setattr(fused, "SKINNY", "on")
    outs = []
    for on in (True, False):
        monkeypatch.setattr(pdl, "PDL", on)
        eng = LLMEngine(cfg)
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
        outs.append([eng.generate([p], params)[0].token_ids for p in prompts[:2]])  # batch 1
        del eng
    assert outs[0] == outs[2] and outs[1] == outs[3]
