"""The decoder's skinny path (``LlamaDecoderLayer.forward_skinny``: steps of <= 16 tokens through fused
norm+GEMM / GEMM+residual / GEMM+activation ops, the residual stream updated in place) gives the same tokens
as the unfused layers: plain decoding, DFlash (whose verification steps capture target layers) and on a GPU."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.layers import fused
from flexspec.models.llama import LlamaDecoderLayer
from tests.conftest import DEFAULT_MODEL, real_prompts
from tests.spec.conftest import spec_engine


@pytest.fixture
def skinny_calls(monkeypatch):
    """Counts the layer calls that take the skinny path; returns the counter."""
    calls = {"n": 0, "rows": set()}
    layer_fn = LlamaDecoderLayer.forward_skinny

    def counted(self, h, meta):
        calls["n"] += 1
        calls["rows"].add(h.shape[0])
        return layer_fn(self, h, meta)

    monkeypatch.setattr(LlamaDecoderLayer, "forward_skinny", counted)
    return calls


@pytest.fixture(scope="module")
def case(engine):
    prompts = real_prompts(engine, n_each=2)
    params = SamplingParams(max_tokens=20, temperature=0)
    return prompts, params, [o.token_ids for o in engine.generate(prompts, params)]


def test_plain_decode_through_skinny_path_is_exact(engine, case, skinny_calls, monkeypatch):
    prompts, params, want = case
    monkeypatch.setattr(fused, "SKINNY", "torch")  # the torch reference of the fused ops, on CPU
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    # 6 sequences decode together (6 rows), then fewer as they finish; 30 layers per step
    assert skinny_calls["n"] >= 30 * 19 and 6 in skinny_calls["rows"], skinny_calls


def test_dflash_verification_through_skinny_path_is_exact(case, skinny_calls, monkeypatch):
    """Verification steps of 2 x 5 tokens capture DFlash's target layers from the in-place residual stream:
    the same outputs, drafts and acceptances as through the unfused layers."""
    prompts, params, want = case
    spec = {"method": "dflash", "model": "smollm2-135m-instruct-dflash", "num_speculative_tokens": 4,
            "execution": "decoupled"}  # fmt: skip
    runs = []
    for mode in ("off", "torch"):
        monkeypatch.setattr(fused, "SKINNY", mode)
        eng = spec_engine(spec, max_num_seqs=2)
        outs = [o.token_ids for o in eng.generate(prompts, params)]
        runs.append((outs, eng.spec_metrics.num_draft_tokens, eng.spec_metrics.num_accepted_tokens))
    assert runs[0] == runs[1] and runs[0][0] == want and runs[0][2] > 0
    assert 10 in skinny_calls["rows"], skinny_calls


def test_skinny_path_only_where_it_applies(engine, monkeypatch):
    """Off by default on CPU, never for more than 16 rows, never while gradients are needed."""
    x = torch.zeros(4, 8)
    assert not fused.use_skinny(x)  # "auto" on CPU
    monkeypatch.setattr(fused, "SKINNY", "torch")
    assert fused.use_skinny(x) and not fused.use_skinny(torch.zeros(17, 8))
    w = torch.nn.Parameter(torch.zeros(8))
    assert not fused.use_skinny(x, w) and fused.use_skinny(x.detach(), w.detach())
    monkeypatch.setattr(fused, "SKINNY", "off")
    assert not fused.use_skinny(x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skinny_path_on_gpu_matches_unfused_layers(case, dtype, skinny_calls, monkeypatch):
    """With the Triton kernels and CUDA graphs: fp32 gives the same tokens as the unfused layers; in bf16 (sums
    in another order, so a near-tie may flip a greedy choice) most sequences stay identical."""
    prompts, params, _ = case
    cfg = EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cuda", dtype=dtype, max_num_seqs=8)
    outs = []
    for mode in ("off", "auto"):
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
