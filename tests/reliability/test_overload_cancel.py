"""Overload and cancellation against the real Serve app (issue 9, items 2 and 4).

Overload: the engine deployment admits ``max_ongoing_requests`` (16) per replica and queues up to
``max_queued_requests`` (64) more at the ingress's handle; past that, requests get 503 + ``Retry-After`` at
once. Nothing hangs: every request gets an answer, every admitted one completes.

Cancellation: clients that disconnect mid-stream (or mid-request) abort their engine sequences, so after 100
of them the engine runs nothing and the KV-cache usage (``vllm:kv_cache_usage_perc`` at /metrics) is back to
its baseline, empty.
"""

from __future__ import annotations

import asyncio
import json

import httpx

NUM_OVERLOAD = 160  # > 16 running + 64 queued
MAX_TOKENS = 8


async def _one(h: httpx.AsyncClient, server, i: int) -> tuple[int, dict[str, str], object]:
    """Request ``i`` (every 4th streamed): (status, headers, parsed body or list of SSE events)."""
    body = {
        "model": server.model,
        "prompt": f"List {i} planets:",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    if i % 4 == 0:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with h.stream("POST", f"{server.api}/completions", json=body, headers=server.headers) as r:
            if r.status_code != 200:
                return r.status_code, dict(r.headers), json.loads(await r.aread())
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            return 200, dict(r.headers), events
    r = await h.post(f"{server.api}/completions", json=body, headers=server.headers)
    return r.status_code, dict(r.headers), r.json()


def test_overload_sheds_with_retry_after_and_admitted_requests_complete(rel_server):
    rel_server.wait_idle()

    async def run() -> list[tuple[int, dict[str, str], object]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=600, limits=limits) as h:
            return await asyncio.gather(*(_one(h, rel_server, i) for i in range(NUM_OVERLOAD)))

    results = asyncio.run(run())  # every request answered (a hang would end in the client's timeout error)
    codes = [status for status, _, _ in results]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) > 0 and codes.count(200) >= 16, codes
    for (status, headers, body), i in zip(results, range(NUM_OVERLOAD)):
        if status == 503:
            assert headers["retry-after"] == "2"
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_overloaded"
        elif i % 4 == 0:  # admitted stream: every token, the usage chunk, then [DONE]
            assert body[-1] == "[DONE]"
            chunks = [json.loads(e) for e in body[:-1]]
            assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            assert [
                c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]
            ] == ["length"]
        else:
            assert body["usage"]["completion_tokens"] == MAX_TOKENS
            assert body["choices"][0]["finish_reason"] == "length"
    rel_server.wait_idle()
    rel_server.valid_request()


def test_hundred_client_disconnects_free_sequences_and_kv_blocks(rel_server):
    """80 streams dropped after their first tokens + 20 non-streamed requests whose clients time out: the
    engine aborts all 100 (each asked for 400 tokens, far more than the test waits for)."""
    baseline = rel_server.wait_idle()
    assert baseline["vllm:kv_cache_usage_perc"] == 0.0
    body = {
        "model": rel_server.model,
        "prompt": "Write a very long story about a dragon who learns to bake bread.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def dropped_stream(h: httpx.AsyncClient) -> int:
        async with h.stream(
            "POST", f"{rel_server.api}/completions", json=body | {"stream": True}, headers=rel_server.headers
        ) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    seen += 1
                    if seen == 2:
                        break
            return seen  # leaving the block closes the connection mid-stream

    async def timed_out_request(h: httpx.AsyncClient) -> bool:
        try:
            await h.post(f"{rel_server.api}/completions", json=body, headers=rel_server.headers, timeout=1.5)
        except httpx.TimeoutException:
            return True
        return False

    async def run() -> tuple[list[int], list[bool]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as h:
            seen: list[int] = []
            for _ in range(8):  # waves of 10 concurrent streams, so each gets admitted and starts
                seen += await asyncio.gather(*(dropped_stream(h) for _ in range(10)))
            timed_out = await asyncio.gather(*(timed_out_request(h) for _ in range(20)))
            return seen, timed_out

    seen, timed_out = asyncio.run(run())
    assert seen == [2] * 80
    assert all(timed_out)
    after = rel_server.wait_idle(timeout_s=60)
    assert after == baseline  # nothing running or waiting, KV cache empty again
    rel_server.valid_request()
