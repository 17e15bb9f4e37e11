"""Multi-token steps stop exactly where plain decoding stops (issue 3): max_tokens, EOS and stop strings
inside an accepted run, and prompts near max_model_len."""

from __future__ import annotations

from configs import SamplingParams
from tests.conftest import DEFAULT_MODEL
from tests.spec.conftest import spec_engine

# A self-drafting draft model accepts (almost) every draft, so runs of K+1 tokens per step are the norm and
# every stop condition lands inside an accepted run.
SELF_DRAFT = {"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 6}


def chat(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


def test_max_tokens_inside_accepted_run(engine):
    eng = spec_engine(SELF_DRAFT)
    ids = chat(engine, "List five fruits.")
    for n in (1, 3, 10, 17):
        ref = engine.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0]
        out = eng.generate([ids], SamplingParams(max_tokens=n, temperature=0))[0]
        assert out.token_ids == ref.token_ids and len(out.token_ids) == n
        assert out.finish_reason == ref.finish_reason == "length"


def test_eos_inside_accepted_run(engine):
    eng = spec_engine(SELF_DRAFT)
    ids = chat(engine, "What is 2+3? Answer with one number.")
    ref = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0]
    out = eng.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] == engine.tokenizer.eos_token_id
    assert out.token_ids == ref.token_ids and out.finish_reason == "stop"
    assert eng.spec_metrics.mean_acceptance_length > 2


def test_stop_string_in_middle_of_accepted_run(engine):
    eng = spec_engine(SELF_DRAFT)
    ids = chat(engine, "Write a short poem about the sea.")
    full = engine.generate([ids], SamplingParams(max_tokens=48, temperature=0))[0]
    stop = full.text.split()[9]
    ref = engine.generate([ids], SamplingParams(max_tokens=48, temperature=0, stop=[stop]))[0]
    out = eng.generate([ids], SamplingParams(max_tokens=48, temperature=0, stop=[stop]))[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        ref.token_ids,
        ref.text,
        ref.finish_reason,
        ref.stop_reason,
    )
    assert out.finish_reason == "stop" and stop not in out.text


def test_usage_and_logprobs_count_equal_tokens(engine):
    eng = spec_engine(SELF_DRAFT)
    ids = chat(engine, "Name three colors.")
    eng.add_request(ids, SamplingParams(max_tokens=20, temperature=0, logprobs=2))
    ntok, nlp, text = 0, 0, ""
    while eng.has_unfinished:
        for o in eng.step():
            ntok += len(o.new_token_ids)
            nlp += len(o.new_logprobs)
            text += o.new_text
            last = o
    assert ntok == nlp == len(last.token_ids) and text == last.text


def test_prompt_at_max_model_len_minus_k_plus_1_degrades_gracefully(engine):
    K = 6
    max_len = 256
    eng = spec_engine(SELF_DRAFT, max_model_len=max_len)
    plain = spec_engine({"method": "ngram", "num_speculative_tokens": 1}, max_model_len=max_len)
    base = chat(engine, "Tell me a long story about a dragon. " * 30)
    ids = base[: max_len - K + 1]
    out = eng.generate([ids], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.finish_reason == "length"
    assert len(ids) + len(out.token_ids) == max_len
    ref_engine_out = plain.generate([ids], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.token_ids == ref_engine_out.token_ids
