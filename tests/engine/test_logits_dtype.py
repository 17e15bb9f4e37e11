"""The engine keeps the target's logits in the model dtype (bf16 on GPU) and every consumer upcasts itself:
the tokens, seeded samples, logprobs and speculative acceptances must equal those of fp32 logits exactly.

Runs a random 2-layer Llama in bf16 on the CPU (tiny, so bf16 CPU matmuls stay fast)."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from flexspec.models.llama import LlamaForCausalLM
from tests.spec.test_mtp import tiny_target  # noqa: F401  (random 2-layer Llama, the default tokenizer)

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def fibonacci(n):\n    ",
    "Write a haiku about the sea. The sea, the sea, the sea.",
]


def _run(model_dir: str, speculative: dict | None) -> list[tuple]:
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            dtype="bfloat16",
            max_model_len=256,
            speculative_config=speculative,
        )
    )
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, logprobs=1),
    ]
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {i: [] for i in ids}
    while eng.has_unfinished:
        for o in eng.step():
            logprobs[o.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in o.new_logprobs]
            if o.finished:
                tokens[o.request_id] = list(o.token_ids)
    return [(tokens[i], logprobs[i]) for i in ids]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 4}])
def test_bf16_logits_give_the_same_results_as_fp32(tiny_target, monkeypatch, speculative):  # noqa: F811
    got = _run(tiny_target, speculative)
    original = LlamaForCausalLM.compute_logits
    seen: list[torch.dtype] = []

    def always_fp32(self, hidden, upcast=True):
        out = original(self, hidden, upcast=True)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", always_fp32)
    want = _run(tiny_target, speculative)
    assert seen and set(seen) == {torch.float32}
    assert got == want
    assert all(len(tokens) == 24 for tokens, _ in got)


def test_compute_logits_upcast_flag(tiny_target):  # noqa: F811
    eng = LLMEngine(EngineConfig(model=str(tiny_target), device="cpu", dtype="bfloat16", max_model_len=64))
    model = eng.executor.runner.model
    hidden = torch.randn(3, model.spec.hidden_size, dtype=torch.bfloat16)
    raw = model.compute_logits(hidden, upcast=False)
    full = model.compute_logits(hidden)
    assert raw.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(raw.float(), full)
