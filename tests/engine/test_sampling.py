"""Sampling parameters, stop conditions and logprobs (issue 2, 3)."""

from __future__ import annotations

import torch

from configs import SamplingParams

PROMPT = "Write a short poem about the sea."


def chat(engine, text=PROMPT):
    return engine.apply_chat_template([{"role": "user", "content": text}])


def test_seed_makes_sampling_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a = engine.generate([chat(engine)], p)[0].token_ids
    b = engine.generate([chat(engine), chat(engine, "Hello!"), chat(engine, "2+2?")], [p, p, p])[0].token_ids
    c = engine.generate([chat(engine)], SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99))[
        0
    ]
    assert a == b
    assert a != c.token_ids


def test_top_k_1_is_greedy(engine):
    greedy = engine.generate([chat(engine)], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
    topk1 = engine.generate([chat(engine)], SamplingParams(max_tokens=24, temperature=1.3, top_k=1, seed=5))[
        0
    ]
    assert topk1.token_ids == greedy


def test_max_tokens_and_finish_reasons(engine):
    o = engine.generate([chat(engine)], SamplingParams(max_tokens=5, temperature=0))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    o = engine.generate(
        [chat(engine, "What is 2+3? Answer with one number.")], SamplingParams(max_tokens=64, temperature=0)
    )[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == engine.tokenizer.eos_token_id


def test_stop_string_truncates_text_and_tokens(engine):
    full = engine.generate([chat(engine)], SamplingParams(max_tokens=40, temperature=0))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    o = engine.generate([chat(engine)], SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert stop not in o.text and full.text.startswith(o.text)
    assert full.token_ids[: len(o.token_ids)] == o.token_ids
    assert len(o.token_ids) < len(full.token_ids)


def test_stop_token_ids(engine):
    full = engine.generate([chat(engine)], SamplingParams(max_tokens=20, temperature=0))[0]
    tok = full.token_ids[6]
    o = engine.generate([chat(engine)], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tok]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == tok
    assert o.token_ids == full.token_ids[: full.token_ids.index(tok) + 1]


def test_streamed_deltas_concatenate_to_text(engine):
    rid = engine.add_request(chat(engine), SamplingParams(max_tokens=30, temperature=0, stop=["sea"]))
    pieces, ntok = [], 0
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id == rid:
                pieces.append(o.new_text)
                ntok += len(o.new_token_ids)
                last = o
    assert "".join(pieces) == last.text and ntok == len(last.token_ids)


def test_logprobs_match_log_softmax(engine, hf_model):
    ids = chat(engine)
    o = engine.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    seq = torch.tensor([ids + o.token_ids])
    with torch.no_grad():
        logits = hf_model(seq).logits[0, len(ids) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1)
    assert len(o.token_ids) == 6
    from flexspec.engine.llm_engine import LLMEngine  # noqa: F401 - API under test

    lps = _collect_logprobs(engine, ids)
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-3
        top_ids = [t for t, _ in lp.top]
        assert top_ids == ref[i].topk(3).indices.tolist()


def _collect_logprobs(engine, ids):
    rid = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0, logprobs=3))
    out = []
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id == rid:
                out.extend(o.new_logprobs)
    return out
