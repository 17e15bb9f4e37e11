"""The real Serve app on loopback, driven by the official ``openai`` SDK (and raw HTTP for error shapes).

Reference outputs come from an in-process ``LLMEngine`` (the session ``engine`` fixture) at T=0.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from configs import SamplingParams

QUESTIONS = [
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def chat_ref(engine, question: str, max_tokens: int) -> object:
    ids = engine.apply_chat_template([{"role": "user", "content": question}])
    return engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]


def wait_engine_idle(server, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until the engine reports no running/waiting request and an empty KV cache."""
    deadline = time.monotonic() + timeout_s
    values: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.base_url}/metrics").text
        values = {}
        for line in text.splitlines():
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            ):
                if line.startswith(name + "{"):
                    values[name] = float(line.rsplit(" ", 1)[1])
        if len(values) == 3 and not any(values.values()):
            return values
        time.sleep(0.5)
    raise AssertionError(f"engine not idle after {timeout_s}s: {values}")


# ---- info routes ------------------------------------------------------------------------------------------
def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---- generation equals the engine's own T=0 output ----------------------------------------------------------
def test_chat_matches_engine(client, server, engine):
    ref = chat_ref(engine, QUESTIONS[0], 32)
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_tokens=32
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_matches_engine(client, server, engine):
    prompt = "def fibonacci(n):"
    ref = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    r = client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=24)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_stream_with_usage_counts_streamed_tokens(client, server, engine):
    ref = chat_ref(engine, QUESTIONS[2], 24)
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTIONS[2]}],
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    chunks = list(stream)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    streamed = [lp for c in chunks[:-1] if c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert text == ref.text
    assert [c.choices[0].delta.role for c in chunks[:1]] == ["assistant"]
    assert usage_chunk.usage.completion_tokens == len(streamed) == len(ref.token_ids)
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in streamed)
    assert chunks[-2].choices[0].finish_reason == ref.finish_reason


def test_chat_logprob_bytes_of_emoji_split_over_tokens(server, engine):
    """Each emoji of the answer is 3 byte-level tokens: every entry carries its raw ``bytes``, which
    concatenate to the answer's UTF-8; partial tokens are named ``bytes:\\xNN`` (never U+FFFD)."""
    question = "Give me three emojis for happiness."
    ref = chat_ref(engine, question, 12)
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
    }
    choice = httpx.post(f"{server.api}/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["message"]["content"] == ref.text and ref.text.startswith("🌱")  # the model's T=0 answer
    content = choice["logprobs"]["content"]
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in content)
    tops = [t for e in content for t in e["top_logprobs"]]
    assert len(tops) == 3 * len(content) and all(set(t) == {"token", "logprob", "bytes"} for t in tops)
    assert b"".join(bytes(e["bytes"]) for e in content) == ref.text.encode("utf-8")
    assert [e["token"] for e in content[:3]] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\xb1"]
    for e in content + tops:
        assert "\ufffd" not in e["token"]
        if not e["token"].startswith("bytes:"):
            assert bytes(e["bytes"]) == e["token"].encode("utf-8")


def test_completion_logprobs_keep_legacy_shape_with_partial_tokens(server, engine):
    """Legacy logprobs: same four lists; partial tokens named ``bytes:\\xNN``; every part of a character
    split over tokens has that character's ``text_offset``."""
    prompt = "Plants: 🌱🌱"
    ref = engine.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0))[0]
    body = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 9, "logprobs": 2}
    choice = httpx.post(f"{server.api}/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["text"] == ref.text == "🌱🌱🌱"
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == ["bytes:\\xf0\\x9f", "bytes:\\x8c", "bytes:\\xb1"] * 3
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 9
    assert all(isinstance(d, dict) and len(d) == 2 for d in lp["top_logprobs"])
    assert lp["text_offset"] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_completion_stream_without_usage(client, server, engine):
    prompt = "The three primary colors are"
    ref = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    chunks = list(
        client.completions.create(
            model=server.model, prompt=prompt, temperature=0, max_tokens=16, stream=True
        )
    )
    assert all(c.choices for c in chunks)  # no usage chunk unless asked
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_concurrent_streams(server, engine):
    """Four streams at once (batched by the engine) each equal their own T=0 reference."""
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    refs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))

    async def one(aclient: openai.AsyncOpenAI, q: str) -> tuple[str, int]:
        stream = await aclient.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": q}],
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
            if c.usage:
                usage = c.usage.completion_tokens
        return text, usage

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(
            base_url=server.api, api_key="unused", max_retries=0, timeout=120
        ) as ac:
            return await asyncio.gather(*(one(ac, q) for q in QUESTIONS))

    results = asyncio.run(run())
    for (text, usage), ref in zip(results, refs):
        assert text == ref.text
        assert usage == len(ref.token_ids)


def test_n_choices_stop_and_seed(client, server, engine):
    ref = chat_ref(engine, QUESTIONS[1], 16)
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        temperature=0,
        max_tokens=16,
        n=2,
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content == ref.text for c in r.choices)
    assert r.usage.completion_tokens == 2 * len(ref.token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)  # the prompt is counted once

    stop = ref.text.split()[1]  # a word from the middle of the reference
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTIONS[1]}],
        temperature=0,
        max_tokens=16,
        stop=[stop],
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref.text[: ref.text.index(stop)]

    kw = {
        "model": server.model,
        "prompt": "Once upon a time",
        "temperature": 0.9,
        "max_tokens": 12,
        "seed": 1234,
    }
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.completion_tokens == 12


# ---- errors in OpenAI's shape -------------------------------------------------------------------------------
def _post(server, path: str, body: object, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(f"{server.api}{path}", content=raw, headers={"Content-Type": "application/json"})
    return httpx.post(f"{server.api}{path}", json=body, timeout=60)


def _assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_bad_inputs_get_openai_errors(server, client):
    msgs = [{"role": "user", "content": "hi"}]
    m = server.model
    _assert_error(
        _post(server, "/chat/completions", {"model": "nope", "messages": msgs}),
        404,
        "model",
        "model_not_found",
    )
    _assert_error(
        _post(server, "/chat/completions", {"model": m, "messages": msgs, "temperature": -1}),
        400,
        "temperature",
    )
    _assert_error(
        _post(server, "/chat/completions", {"model": m, "messages": msgs, "max_tokens": 0}), 400, "max_tokens"
    )
    _assert_error(
        _post(server, "/chat/completions", {"model": m, "messages": msgs, "top_p": 0}), 400, "top_p"
    )
    _assert_error(  # once a 503 that stopped the replica's engine loop (int64 overflow in the sampler)
        _post(server, "/completions", {"model": m, "prompt": "hi", "temperature": 1, "top_k": 10**23}),
        400,
        "top_k",
    )
    _assert_error(_post(server, "/chat/completions", {"model": m}), 400, "messages")
    _assert_error(_post(server, "/chat/completions", {"model": m, "messages": []}), 400, "messages")
    _assert_error(_post(server, "/chat/completions", {"model": m, "messages": [{"role": "wizard"}]}), 400)
    _assert_error(_post(server, "/chat/completions", None, raw=b"{not json"), 400)
    _assert_error(_post(server, "/chat/completions", [1, 2]), 400)
    _assert_error(
        _post(server, "/chat/completions", {"model": m, "messages": msgs, "tools": [{"type": "x"}]}),
        400,
        "tools",
    )
    _assert_error(
        _post(server, "/chat/completions", {"model": m, "messages": msgs, "presence_penalty": 1}),
        400,
        "presence_penalty",
    )
    _assert_error(
        _post(server, "/completions", {"model": m, "prompt": "hi", "max_tokens": 5000}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    _assert_error(_post(server, "/completions", {"model": m, "prompt": [999999999]}), 400, "prompt")
    long_prompt = "hello " * 2000  # > max_model_len tokens, < max_request_bytes
    _assert_error(
        _post(server, "/completions", {"model": m, "prompt": long_prompt}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    _assert_error(_post(server, "/completions", {"model": m, "prompt": "x" * 70000}), 413)
    resp = httpx.get(f"{server.api}/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"  # OpenAI codes are strings
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=msgs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=msgs, temperature=5000)
    assert e.value.body["param"] == "temperature"
    wait_engine_idle(server)  # rejected requests leave nothing behind


# ---- cancellation, overload, metrics ------------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv(server):
    body = {
        "model": server.model,
        "prompt": "Count from one to one thousand:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{server.api}/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(12)) if line.startswith("data: ")]
        assert len(got) >= 3
    # Connection closed after a few tokens: the engine must drop the sequence well before 400 tokens.
    values = wait_engine_idle(server, timeout_s=20)
    assert values["vllm:kv_cache_usage_perc"] == 0.0


def _unretrieved_exceptions_logged() -> int:
    """Lines of asyncio's "Future/Task exception was never retrieved" in this Ray session's logs (the Serve
    replicas' stderr lands in ``worker-*.err``)."""
    import glob
    import os

    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()  # no public API without the dashboard
    count = 0
    for path in glob.glob(os.path.join(logs, "**", "*"), recursive=True):
        if path.endswith((".err", ".out", ".log")) and os.path.isfile(path):
            with open(path, errors="replace") as f:
                count += sum("exception was never retrieved" in line for line in f)
    return count


def test_stream_disconnects_are_quiet_in_the_ingress_log(server):
    """Serve's receive proxy hands the ingress a ``TaskCancelledError`` when a streaming client leaves; it
    used to fail the response and be logged as "Future exception was never retrieved" (~1 disconnect in 10
    before the fix, none in 96 after). Every dropped stream must still be aborted in the engine."""
    before = _unretrieved_exceptions_logged()
    completion = {"model": server.model, "prompt": "Write a long story about a dragon."}
    chat = {"model": server.model, "messages": [{"role": "user", "content": "Tell a long story."}]}

    async def dropped(h: httpx.AsyncClient, path: str, body: dict) -> int:
        body = body | {"max_tokens": 300, "ignore_eos": True, "stream": True}
        async with h.stream("POST", f"{server.api}{path}", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            return seen  # leaving the block closes the connection mid-stream

    async def run() -> list[int]:
        seen: list[int] = []
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as h:
            for _ in range(5):  # waves of 6 concurrent streams (max_num_seqs=8)
                seen += await asyncio.gather(
                    *(dropped(h, "/completions", completion) for _ in range(4)),
                    *(dropped(h, "/chat/completions", chat) for _ in range(2)),
                )
        return seen

    assert asyncio.run(run()) == [3] * 30
    wait_engine_idle(server, timeout_s=30)  # every dropped stream was aborted in the engine
    httpx.get(f"{server.base_url}/health", timeout=30)  # a little more work in the ingress (its gc runs)
    time.sleep(2)
    assert _unretrieved_exceptions_logged() == before


def test_overload_returns_503_with_retry_after(server):
    """max_ongoing_requests=8 + max_queued_requests=8 (requests not yet assigned to a replica, in-flight
    assignment included): of 40 simultaneous requests some are shed, the rest complete."""

    async def one(h: httpx.AsyncClient) -> httpx.Response:
        body = {"model": server.model, "prompt": "List the planets:", "max_tokens": 8, "ignore_eos": True}
        return await h.post(f"{server.api}/completions", json=body)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as h:
            return await asyncio.gather(*(one(h) for _ in range(40)))

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    shed = [r for r in responses if r.status_code == 503]
    assert codes.count(200) >= 8 and shed, codes
    for r in shed:
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "server_overloaded"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 8
    wait_engine_idle(server)


def test_metrics_exposes_vllm_names(server, client):
    before = httpx.get(f"{server.base_url}/metrics").text
    client.completions.create(
        model=server.model, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text = httpx.get(f"{server.base_url}/metrics").text
    label = f'model_name="{server.model}"'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "flexspec:execution_mode_steps_total",
        "flexspec:step_seconds_bucket",
    ):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name

    def value(t: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in t.splitlines() if line.startswith(name + "{"))

    assert value(text, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") == 5
    assert value(text, "flexspec:execution_mode_steps_total") == value(text, "flexspec:step_seconds_count")
    assert "_created" not in text


def test_metrics_spec_decode_counters_equal_engine(server, client):
    """After real requests through the Serve app, the scraped vllm:spec_decode_* counters equal the replica
    engine's own ``spec_metrics`` (one replica, idle when scraped)."""
    for prompt in ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return", "1, 2, 3, 4, 5,"):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=24, temperature=0)
    wait_engine_idle(server)
    want = server.llm_handle().spec_decode_metrics.remote().result()
    text = httpx.get(f"{server.base_url}/metrics").text
    samples: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, rest = line.split("{", 1)
            labels, v = rest.rsplit("} ", 1)
            assert f'model_name="{server.model}"' in labels and 'engine="' in labels
            pos = labels.split('position="', 1)[1].split('"', 1)[0] if "position=" in labels else ""
            samples.setdefault(name, {})[pos] = float(v)
    assert want["num_drafts"] > 0
    assert samples["vllm:spec_decode_num_drafts_total"] == {"": want["num_drafts"]}
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == {"": want["num_draft_tokens"]}
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == {"": want["num_accepted_tokens"]}
    per_pos = samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos == {str(i): n for i, n in enumerate(want["num_accepted_tokens_per_pos"])}
    assert json.loads(httpx.get(f"{server.api}/models").text)["data"][0]["max_model_len"] == 1024
