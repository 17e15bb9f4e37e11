"""Memory budget (issue 9, item 8): the drafter's weights, buffers and KV cache come out of the same budget as
the target's KV cache (on CPU ``cpu_kv_cache_gib``, on GPU ``gpu_memory_utilization``), so the total never
exceeds it; at that budget a max-length prompt is admitted and completes, one token more is refused at
admission, and a budget that cannot hold one max-length sequence fails at start-up with a clear error.

The drafter is ``draft_model`` with the target itself as the draft (its cache is as large as the target's),
in ``decoupled`` mode so it drafts every step.
"""

from __future__ import annotations

import pytest

from configs import EngineConfig, SamplingParams
from flexspec.errors import ContextLengthExceededError
from tests.conftest import DEFAULT_MODEL

MAX_MODEL_LEN = 256
BUDGET_GIB = 0.6  # ~63 blocks of 16 tokens once the drafter (538 MB of weights) is paid
DRAFT = {
    "method": "draft_model",
    "model": DEFAULT_MODEL,
    "num_speculative_tokens": 2,
    "execution": "decoupled",
}


def _config(cpu_kv_cache_gib: float) -> EngineConfig:
    return EngineConfig(
        model=DEFAULT_MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,  # the batch bound (64 full sequences) is above the budget: the budget decides
        max_num_batched_tokens=512,
        cpu_kv_cache_gib=cpu_kv_cache_gib,
        speculative_config=DRAFT,
    )


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _kv_bytes(runner) -> int:
    return _bytes([a.k_cache for a in runner.attn_layers] + [a.v_cache for a in runner.attn_layers])


@pytest.fixture(scope="module")
def draft_engine():
    from flexspec.engine.llm_engine import LLMEngine

    eng = LLMEngine(_config(BUDGET_GIB))
    yield eng
    eng.shutdown()


def test_drafter_weights_buffers_and_cache_fit_the_budget(draft_engine):
    runner = draft_engine.executor.runner
    drafter = runner.spec_worker.drafter
    draft_weights = _bytes([*drafter.draft.model.parameters(), *drafter.draft.model.buffers()])
    target_kv, draft_kv = _kv_bytes(runner), _kv_bytes(drafter.draft)
    assert draft_kv >= target_kv > 0  # one draft block per target block, plus one sequence of slack
    assert target_kv + draft_kv + draft_weights <= BUDGET_GIB * 2**30
    # What the drafter declares covers what it took.
    declared = drafter.memory_bytes() + runner.num_kv_blocks * drafter.kv_bytes_per_block()
    assert declared >= draft_weights + draft_kv


def test_max_length_prompt_is_admitted_and_completes(draft_engine, engine):
    ids = engine.encode("The quick brown fox jumps over the lazy dog. " * 40)[: MAX_MODEL_LEN - 1]
    out = draft_engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.num_output_tokens == 1 and out.finish_reason == "length"
    ids = ids[: MAX_MODEL_LEN - 6]  # room for 6: drafts that would pass the limit are cut, output stays exact
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = draft_engine.generate([ids], params)[0]
    assert out.token_ids == engine.generate([ids], params)[0].token_ids
    with pytest.raises(ContextLengthExceededError):
        draft_engine.add_request(engine.encode("word " * MAX_MODEL_LEN)[:MAX_MODEL_LEN], SamplingParams())
    assert not draft_engine.has_unfinished and draft_engine.block_manager.usage == 0.0


def test_more_long_prompts_than_the_cache_holds_all_complete(draft_engine, engine):
    """One long prompt more than the KV cache holds at once: the scheduler queues / preempts, nothing runs
    out of memory, every output equals plain decoding."""
    per_seq = -(-MAX_MODEL_LEN // draft_engine.config.kv_block_size)
    n = draft_engine.executor.num_kv_blocks // per_seq + 1
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    prompts = [engine.encode(" ".join(words[i % 12 :] + words * 30))[: MAX_MODEL_LEN - 8] for i in range(n)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = draft_engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(prompts, params)]
    assert draft_engine.block_manager.usage == 0.0


def test_budget_below_one_sequence_fails_at_start_with_a_clear_error(draft_engine):
    from flexspec.engine.llm_engine import LLMEngine

    runner = draft_engine.executor.runner
    drafter = runner.spec_worker.drafter
    per_seq = -(-MAX_MODEL_LEN // runner.block_size)
    # Room for half a sequence once the drafter's weights, slack and per-block cache are paid.
    need = drafter.memory_bytes() + per_seq // 2 * (
        runner.kv_bytes_per_block() + drafter.kv_bytes_per_block()
    )
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(_config(need / 2**30))
