"""Worker failure (issue 9, item 3) on a real Serve app whose replica drives its TP=1 rank as a ``TPWorker``
Ray actor (``executor: ray``), health-checked every second.

Killing the rank (``ray.kill``) mid-stream: the stream that already got tokens ends with an OpenAI-shaped
``engine_unavailable`` error event; requests that got nothing yet (a non-streamed one in flight, one sent
after the kill) are retried by the ingress and answer correctly once Serve has replaced the replica (its
health check fails). Killing the rank of an idle replica: the health check's ping notices and Serve replaces
the replica before any request fails. This app also has ``log_requests`` on: its prompts reach the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from pathlib import Path

import httpx
import pytest

from configs import SamplingParams
from tests.conftest import DEFAULT_MODEL
from tests.reliability.conftest import RelServer

APP = "flexspec-wf"
WF_ARGS = {
    "model": DEFAULT_MODEL,
    "served_model_name": "smollm2-wf",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
    "engine": {"device": "cpu", "max_model_len": 512, "max_num_seqs": 8},
    "executor": "ray",
    "cpus_per_worker": 1,
    "log_requests": True,
    "deployment": {
        "max_ongoing_requests": 8,
        "max_queued_requests": 16,
        "retry_after_s": 1,
        "health_check_period_s": 1,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 5,
    },
    "ingress": {"engine_retry_timeout_s": 180},
}
QUESTION = "Name three colors."


@pytest.fixture(scope="module")
def wf_server(serve_http, rel_server):
    """The second app on the package's Serve instance (the first one keeps its CPU; this one takes the other)."""
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(WF_ARGS), name=APP, route_prefix="/wf")
    yield RelServer(f"{serve_http}/wf", WF_ARGS["served_model_name"], APP, None)
    serve.delete(APP)


def _replica_id(server: RelServer) -> str:
    return server.llm_handle().stats.remote().result()["engine"]


def _kill_rank(ray, replica_id: str) -> None:
    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == f"flexspec-tp-{replica_id}-rank0"
    ]
    assert len(names) == 1, ray.util.list_named_actors(all_namespaces=True)
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def _wait_new_replica(server: RelServer, old: str, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # the replica is being replaced
            new = server.llm_handle().stats.remote().result(timeout_s=15)["engine"]
            if new != old and httpx.get(f"{server.base_url}/health", timeout=15).status_code == 200:
                return new
        time.sleep(1)
    raise AssertionError(f"replica {old} was not replaced within {timeout_s}s")


def _chat(question: str, **kw) -> dict:
    return {"model": "smollm2-wf", "messages": [{"role": "user", "content": question}], "temperature": 0} | kw


def test_rank_killed_mid_stream(wf_server, engine, ray_session):
    ids = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    ref = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))[0]
    r = httpx.post(f"{wf_server.api}/chat/completions", json=_chat(QUESTION, max_tokens=32), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    old = _replica_id(wf_server)

    async def scenario() -> tuple[list[dict], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as h:
            got_tokens = asyncio.Event()

            async def stream() -> list[dict]:
                body = _chat("Tell me a long story.", max_tokens=400, ignore_eos=True, stream=True)
                events, content = [], 0
                async with h.stream("POST", f"{wf_server.api}/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line[6:])
                        if line != "data: [DONE]" and (json.loads(line[6:]).get("choices") or [{}])[0].get(
                            "delta", {}
                        ).get("content"):
                            content += 1
                            if content == 3:
                                got_tokens.set()
                return [json.loads(e) for e in events if e != "[DONE]"] + [{"done": events[-1] == "[DONE]"}]

            streaming = asyncio.create_task(stream())
            in_flight = asyncio.create_task(
                h.post(f"{wf_server.api}/chat/completions", json=_chat(QUESTION, max_tokens=32))
            )
            await asyncio.wait_for(got_tokens.wait(), 120)
            await asyncio.to_thread(_kill_rank, ray_session, old)
            after = await h.post(f"{wf_server.api}/chat/completions", json=_chat(QUESTION, max_tokens=32))
            return await streaming, await in_flight, after

    events, in_flight, after = asyncio.run(scenario())
    # The stream that already had tokens: a clear error event in OpenAI's shape, then the end of the stream.
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and events[-1] == {"done": True}, events[-3:]
    assert (
        set(errors[0]) == {"message", "type", "param", "code"} and errors[0]["type"] == "engine_unavailable"
    )
    assert "WorkerGroupError" in errors[0]["message"]
    assert sum(bool(e.get("choices") and e["choices"][0]["delta"].get("content")) for e in events) >= 3
    # Requests that had sent nothing to their clients were retried on the rebuilt replica.
    for resp in (in_flight, after):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == ref.text
        assert resp.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    new = _wait_new_replica(wf_server, old)
    assert new != old
    r = httpx.post(f"{wf_server.api}/chat/completions", json=_chat(QUESTION, max_tokens=32), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text


def test_rank_killed_while_idle_is_caught_by_the_health_check(wf_server, engine, ray_session):
    old = _wait_new_replica(wf_server, "none")  # whatever replica runs now, once healthy
    _kill_rank(ray_session, old)
    new = _wait_new_replica(wf_server, old)  # no request needed: the health check pings the rank
    assert new != old
    ids = engine.apply_chat_template([{"role": "user", "content": QUESTION}])
    ref = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    r = httpx.post(f"{wf_server.api}/chat/completions", json=_chat(QUESTION, max_tokens=16), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text


def test_log_requests_on_puts_prompts_in_the_replica_log(wf_server, ray_session):
    marker = "MARKER" + secrets.token_hex(8)
    r = httpx.post(
        f"{wf_server.api}/completions",
        json={"model": "smollm2-wf", "prompt": marker, "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.monotonic() + 30
    while not any(
        marker in p.read_text(errors="replace") for p in logs.glob(f"replica_{APP}_LLMServer_*.log")
    ):
        assert time.monotonic() < deadline, "the prompt of a log_requests app is not in its replica log"
        time.sleep(1)
