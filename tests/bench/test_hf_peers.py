"""transformers peers (issue 7): the static-cache + torch.compile peer equals the dynamic-cache peer at T=0 and
compiles once per batch size; a per-system time budget interrupts a call that would run past it."""

from __future__ import annotations

import time

import pytest

from bench.hf_peers import HFPeer, PeerTimeout, SystemBudget, matching_fraction, run_requests


def test_budget_interrupts_a_long_call():
    budget = SystemBudget("slow_peer", 0.2)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="slow_peer: its time budget of 0.2 s is exhausted"), budget.guard():
        time.sleep(10)
    assert time.monotonic() - t0 < 2
    with pytest.raises(PeerTimeout), budget.guard():  # later calls are refused at once
        pass


def test_budget_sees_through_wrapped_alarm():
    """torch._dynamo re-raises an exception from inside tracing as its own error type."""
    budget = SystemBudget("compiled_peer", 0.2)
    with pytest.raises(PeerTimeout) as info, budget.guard():
        try:
            time.sleep(10)
        except PeerTimeout as e:
            raise RuntimeError("wrapped by the compiler") from e
    assert isinstance(info.value.__cause__, RuntimeError)


def test_budget_keeps_an_outer_alarm():
    """pytest-timeout (signal method) and others use SIGALRM too: their timer survives a guarded call."""
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        with SystemBudget("x", 0.1).guard():  # ours fires first: it takes over, then re-arms the outer one
            time.sleep(0.01)
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with SystemBudget("y", 60).guard():  # the outer alarm fires first: ours stays out of its way
            time.sleep(0.2)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_budget_off():
    budget = SystemBudget("x", 0)
    assert budget.remaining() is None and not budget.exhausted()
    with budget.guard():
        pass


@pytest.fixture(scope="module")
def tiny_peer(tmp_path_factory):
    """A 2-layer random Llama with the default model's tokenizer (compiles in seconds on CPU)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flexspec.models.loader import resolve_model_dir

    path = tmp_path_factory.mktemp("tiny-llama")
    AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct"))).save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return HFPeer(str(path), "cpu", torch.float32)


def test_static_compile_equals_dynamic(tiny_peer):
    prompts = [[5, 17, 42, 99, 7], [8, 300, 12]]  # left-padded to one length
    pad_to = max(map(len, prompts))
    ref = run_requests(tiny_peer, "hf_dynamic", prompts, 2, 6, 0.0, True, pad_to)["token_ids"]
    try:
        budget = SystemBudget("hf_static_compile", 120)
        rec = run_requests(tiny_peer, "hf_static_compile", prompts, 2, 6, 0.0, True, pad_to, budget=budget)
        assert rec["output_tokens"] == 12 and matching_fraction(rec["token_ids"], ref) == 1.0
        assert rec["compiled_graphs"] == {"warmup": 1, "timed": 0}  # compiled once, before timing
        again = run_requests(tiny_peer, "hf_static_compile", prompts, 2, 6, 0.0, True, pad_to, budget=budget)
        assert again["compiled_graphs"] == {"warmup": 0, "timed": 0} and again["token_ids"] == ref
    finally:
        tiny_peer.reset_compile()
