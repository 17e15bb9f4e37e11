"""Greedy output of our engine == transformers generate(do_sample=False), fp32 on CPU (issue 2)."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from tests.conftest import real_prompts

pytestmark = pytest.mark.slow  # among the longest modules: scheduled first

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=False)


def hf_greedy(hf_model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(ids) :].tolist()


def hf_greedy_batch(hf_model, prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
    """``generate(do_sample=False)`` on all prompts at once (left padding, attention mask), each output cut after
    its first EOS: one forward per token for the batch instead of one per token per prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=eos,
        )  # fmt: skip
    refs = []
    for row in out[:, width:].tolist():
        refs.append(row[: row.index(eos) + 1] if eos in row else row)
    return refs


def test_21_real_prompts_match_transformers(engine, hf_model, plain_128):
    """The engine's greedy tokens of 21 real prompts in one continuous batch (mixed lengths), 64 each (or up to
    EOS), equal transformers'. They are the first 64 of the session's ``plain_128`` run, which tests/spec needs
    anyway: greedy decoding stops on EOS alone before max_tokens, and its first 64 steps hold the same batch as a
    max_tokens=64 run, so they compute the same tokens (max_tokens itself: tests/engine/test_async_output.py)."""
    prompts, outs_128 = plain_128
    assert prompts == real_prompts(engine, n_each=7) and len(prompts) >= 20
    outs = [o[:64] for o in outs_128]
    eos = engine.tokenizer.eos_token_id
    batched = hf_greedy_batch(hf_model, prompts, 64, eos)
    mismatches = []
    for i, (ids, o, ref) in enumerate(zip(prompts, outs, batched)):
        if ref != o:  # batched fp32 GEMMs may round differently: the one-prompt generate decides
            ref = hf_greedy(hf_model, ids, 64, eos)
        if ref != o:
            mismatches.append((i, ref[:12], o[:12]))
    assert not mismatches, mismatches


@pytest.fixture(scope="module")
def alone_8(engine):
    """8 real prompts and the shared engine's greedy 64-token output for each prompt run alone (~30 s on a
    2-core CPU, so computed once for the module)."""
    prompts = real_prompts(engine, n_each=3)[:8]
    return prompts, [engine.generate([p], GREEDY_64)[0].token_ids for p in prompts]


def test_batch_of_8_equals_each_alone(engine, alone_8):
    prompts, alone = alone_8
    batched = [o.token_ids for o in engine.generate(prompts, GREEDY_64)]
    assert batched == alone


def test_chunked_prefill_and_preemption_do_not_change_tokens(engine, alone_8):
    prompts = real_prompts(engine, n_each=2)[:5]
    # The reference: each prompt's greedy tokens run alone, cut to 48 (greedy tokens do not depend on max_tokens;
    # the 5 prompts are among alone_8's: GSM8K 0-1, HumanEval 0-1, MT-Bench 0).
    alone = dict(zip(map(tuple, alone_8[0]), alone_8[1]))
    ref = [alone[tuple(p)][:48] for p in prompts]
    # 16-token steps force chunked prefill; 24 KV blocks of 16 tokens cannot hold 5 sequences -> preemption.
    small = LLMEngine(
        EngineConfig(
            max_model_len=384, max_num_batched_tokens=16, max_num_seqs=8, num_kv_blocks=24, device="cpu"
        )
    )
    outs = small.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == ref
