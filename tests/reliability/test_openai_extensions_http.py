"""OpenAI / vLLM request options over real HTTP (the package's ``rel_server``): model retrieval, the chosen
token among legacy completion logprobs, continuous usage stats, a chat reply continuing the assistant's last
message, and requests their client left (streamed or not) counted in ``vllm:request_success_total``.
References come from the in-process ``engine`` at T=0 (the server's n-gram speculation is exact)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from configs import SamplingParams


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=server.api_key, max_retries=0, timeout=120)


def test_model_retrieval_returns_the_served_models_card(rel_server):
    card = _client(rel_server).models.retrieve(rel_server.model)
    assert card.id == rel_server.model and card.object == "model"


def test_completion_top_logprobs_include_the_chosen_token(rel_server, engine):
    """Legacy logprobs (OpenAI: "the most likely tokens, as well the chosen tokens"): with ``logprobs=0`` each
    entry is the chosen token alone; at T=0 with ``logprobs=2`` the chosen (argmax) token is one of the two."""
    prompt = "The capital of France is"
    ref = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    for k in (0, 2):
        body = {"model": rel_server.model, "prompt": prompt, "temperature": 0, "max_tokens": 6, "logprobs": k}
        r = httpx.post(f"{rel_server.api}/completions", json=body, headers=rel_server.headers, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == ref.text
        lp = choice["logprobs"]
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert top[tok] == value
            assert len(top) == max(k, 1)


def test_continuous_usage_stats_put_each_choices_usage_so_far_on_its_chunks(rel_server):
    """As vLLM: every chunk carries its choice's usage so far (its prompt's tokens, its own tokens); the last
    chunk (no choices) the request's total."""
    body = {
        "model": rel_server.model,
        "messages": [{"role": "user", "content": "Name three colors."}],
        "temperature": 0,
        "max_tokens": 12,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream(
        "POST", f"{rel_server.api}/chat/completions", json=body, headers=rel_server.headers, timeout=120
    ) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(c["usage"] is not None for c in chunks), chunks
    assert all(
        u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in (c["usage"] for c in chunks)
    )
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
    prompt = {c["usage"]["prompt_tokens"] for c in per_choice}
    assert prompt == {last["usage"]["prompt_tokens"]}  # one prompt: each choice reports it
    for i in (0, 1):
        done = [c["usage"]["completion_tokens"] for c in per_choice if c["choices"][0]["index"] == i]
        assert done == sorted(done) and done[0] == 0 and done[-1] == 12, (i, done)


def test_continue_final_message_extends_the_assistants_text(rel_server, engine):
    """``continue_final_message`` (with ``add_generation_prompt: false``) renders the last assistant message
    open, so the reply continues it: the same tokens as the engine given that rendering."""
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France"},
    ]
    text = engine.render_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.rstrip().endswith("The capital of France")  # left open: no end-of-turn after it
    ids = engine.encode(text, add_special_tokens=False)
    ref = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    reply = _client(rel_server).chat.completions.create(
        model=rel_server.model,
        messages=messages,
        temperature=0,
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert reply.choices[0].message.content == ref.text
    plain = engine.generate(
        [engine.apply_chat_template(messages[:1])], SamplingParams(max_tokens=8, temperature=0)
    )
    assert ref.token_ids != plain[0].token_ids  # it continued the given text, not a fresh answer


def test_requests_left_by_their_client_count_as_abort(rel_server):
    def aborted() -> float:
        text = httpx.get(f"{rel_server.base_url}/metrics", headers=rel_server.headers, timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
        )

    before = aborted()
    body = {"model": rel_server.model, "prompt": "Count to one thousand:", "max_tokens": 300, "n": 2,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as h,
        h.stream("POST", f"{rel_server.api}/completions", json=body, headers=rel_server.headers) as resp,
    ):
        assert resp.status_code == 200
        got = [line for line, _ in zip(resp.iter_lines(), range(8)) if line.startswith("data: ")]
        assert len(got) >= 3
    rel_server.wait_idle()
    assert aborted() - before == 2  # both choices
    body = {
        "model": rel_server.model,
        "prompt": "Count to one thousand:",
        "max_tokens": 300,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):  # a client that stops waiting for a non-streamed answer
        httpx.post(f"{rel_server.api}/completions", json=body, headers=rel_server.headers, timeout=2)
    rel_server.wait_idle()
    deadline = time.monotonic() + 10
    while aborted() - before < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert aborted() - before == 3
