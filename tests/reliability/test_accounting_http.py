"""Exact accounting with multi-token (speculative) steps over HTTP (issue 9, item 5).

The app speculates with n-gram drafts (K = 4), so one step, and one SSE chunk, may carry up to 5 tokens.
Whatever the chunking: ``usage.completion_tokens`` == tokens streamed == logprobs entries == the engine's own
T=0 output; stop strings that span tokens and chunks cut the text exactly where the engine does; the
finish reason is right; no response has more than ``max_tokens`` tokens.
"""

from __future__ import annotations

import openai
import pytest

from configs import SamplingParams
from tests.reliability.conftest import MAX_MODEL_LEN

REPETITIVE = (
    "Repeat this line five times: the cat sat on the mat, the dog sat on the log. "
    "the cat sat on the mat, the dog sat on the log."
)
QUESTIONS = [REPETITIVE, "Count from 1 to 20, separated by commas.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def client(rel_server):
    return openai.OpenAI(base_url=rel_server.api, api_key=rel_server.api_key, max_retries=0, timeout=120)


def chat_ids(engine, question: str) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": question}])


def stream_chat(client, server, question: str, **kw) -> tuple[str, list, list, object, list]:
    """(text, chunks with choices, logprob entries, usage, finish reasons) of one streamed chat request."""
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=1,
            **kw,
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # usage comes last, alone
    body = chunks[:-1]
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    entries = [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    reasons = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    return text, body, entries, chunks[-1].usage, reasons


@pytest.mark.parametrize("question", QUESTIONS)
def test_streamed_tokens_equal_usage_equal_logprobs(client, rel_server, engine, question):
    ref = engine.generate([chat_ids(engine, question)], SamplingParams(max_tokens=40, temperature=0.0))[0]
    text, body, entries, usage, reasons = stream_chat(client, rel_server, question, max_tokens=40)
    assert text == ref.text
    assert usage.completion_tokens == len(entries) == len(ref.token_ids) <= 40
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert reasons == [ref.finish_reason]  # exactly one finish reason, on the last content chunk
    assert body[-1].choices[0].finish_reason == ref.finish_reason
    # the logprob entries are the engine's tokens, in order
    assert "".join(e.token for e in entries) == engine.tokenizer.decode(ref.token_ids)


def test_multi_token_chunks_happen_and_are_counted(client, rel_server, engine):
    """The repetitive prompt gets accepted drafts: some chunk carries several tokens, and the count holds."""
    before = rel_server.llm_handle().spec_decode_metrics.remote().result()["num_accepted_tokens"]
    ref = engine.generate([chat_ids(engine, REPETITIVE)], SamplingParams(max_tokens=64, temperature=0.0))[0]
    text, body, _, usage, _ = stream_chat(client, rel_server, REPETITIVE, max_tokens=64)
    after = rel_server.llm_handle().spec_decode_metrics.remote().result()["num_accepted_tokens"]
    per_chunk = [len(c.choices[0].logprobs.content) for c in body if c.choices[0].logprobs]
    assert after > before, "no draft was accepted: the test would not exercise multi-token steps"
    assert max(per_chunk) > 1, per_chunk
    assert sum(per_chunk) == usage.completion_tokens == len(ref.token_ids)
    assert text == ref.text


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 13])
def test_never_more_than_max_tokens(client, rel_server, max_tokens):
    """ignore_eos: exactly max_tokens, finish 'length', whether streamed or not, even when a verification
    step accepts more drafts than the limit leaves room for."""
    kw = {
        "model": rel_server.model,
        "prompt": "one two three one two three one two three one two three",
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True},
    }
    r = client.completions.create(**kw)
    assert r.usage.completion_tokens == max_tokens == len(r.choices[0].logprobs.tokens)
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == chunks[-1].usage.completion_tokens == max_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def _stop_spanning_tokens(engine, token_ids: list[int], first: int, span: int) -> str:
    """A stop string from the last character of token ``first`` to the first of token ``first + span - 1``."""
    decode = engine.tokenizer.decode
    a = len(decode(token_ids[: first + 1]))  # end of token `first`
    b = len(decode(token_ids[: first + span - 1]))  # start of token `first + span - 1`
    return decode(token_ids)[a - 1 : b + 1]


@pytest.mark.parametrize("span", [2, 7])  # 7 tokens > K + 1: the stop string spans at least two chunks
def test_stop_string_spanning_tokens_and_chunks(client, rel_server, engine, span):
    question = QUESTIONS[1]
    ids = chat_ids(engine, question)
    plain = engine.generate([ids], SamplingParams(max_tokens=48, temperature=0.0))[0]
    assert len(plain.token_ids) > 12 + span
    stop = _stop_spanning_tokens(engine, plain.token_ids, 10, span)
    ref = engine.generate([ids], SamplingParams(max_tokens=48, temperature=0.0, stop=[stop]))[0]
    assert ref.finish_reason == "stop" and ref.text == plain.text[: plain.text.index(stop)]

    text, _, entries, usage, reasons = stream_chat(client, rel_server, question, max_tokens=48, stop=[stop])
    assert text == ref.text and stop not in text
    assert reasons == ["stop"]
    assert usage.completion_tokens == len(entries) == len(ref.token_ids)
    r = client.chat.completions.create(
        model=rel_server.model,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=48,
        stop=[stop],
    )
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_n_choices_with_logprobs_count_every_token(client, rel_server, engine):
    prompt = "The days of the week are"
    ref = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    r = client.completions.create(
        model=rel_server.model, prompt=prompt, n=3, max_tokens=12, temperature=0, logprobs=1
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == ref.text and c.finish_reason == ref.finish_reason for c in r.choices)
    assert all(len(c.logprobs.tokens) == len(ref.token_ids) for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_prompts_at_the_context_limit(client, rel_server, engine):
    """A prompt of max_model_len - 1 tokens is admitted and gets its one token; a repetitive prompt that leaves
    room for 5 tokens gets exactly 5 even though drafts would run past the limit; max_model_len tokens is a
    400 ``context_length_exceeded`` at admission."""
    base = engine.encode("one two three four five six seven eight nine ten " * 60)
    r = client.completions.create(
        model=rel_server.model, prompt=base[: MAX_MODEL_LEN - 1], max_tokens=1, temperature=0
    )
    assert r.usage.completion_tokens == 1 and r.usage.prompt_tokens == MAX_MODEL_LEN - 1
    assert r.choices[0].finish_reason == "length"
    ref = engine.generate(
        [base[: MAX_MODEL_LEN - 5]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )[0]
    r = client.completions.create(
        model=rel_server.model,
        prompt=base[: MAX_MODEL_LEN - 5],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].text == ref.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=rel_server.model, prompt=base[:MAX_MODEL_LEN], max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    rel_server.wait_idle()
