"""Load test (issue 9, item 7): 64 concurrent streaming clients for 60 s against the real Serve app (n-gram
speculation, loopback, 1 CPU for the replica) with ``bench/load_test.py``: no request lost or hung, every
answer equal to the engine's own T=0 output for its prompt, exact token accounting; p50 / p99 latency
reported (printed), not asserted."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.load_test import DEFAULT_PROMPTS, LoadConfig, run_load
from configs import SamplingParams

pytestmark = pytest.mark.serial  # 64 clients against a deadline: run alone, not beside a busy test worker

MAX_TOKENS = 16


@pytest.mark.slow
def test_64_streaming_clients_for_60s_lose_nothing_and_stay_exact(rel_server, engine):
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in DEFAULT_PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    references = {p: o.text for p, o in zip(DEFAULT_PROMPTS, outs)}
    drafts_before = rel_server.llm_handle().spec_decode_metrics.remote().result()["num_drafts"]
    cfg = LoadConfig(
        url=rel_server.base_url,
        model=rel_server.model,
        api_key=rel_server.api_key,
        concurrency=64,
        duration_s=60,
        max_tokens=MAX_TOKENS,
        request_timeout_s=90,
        references=references,
    )
    report = asyncio.run(run_load(cfg))
    print(json.dumps({k: report[k] for k in ("requests", "ok", "latency_ms", "ttft_ms", "throughput_tok_s")}))
    assert report["lost"] == 0 and report["hung"] == 0, report["errors"]
    assert report["mismatched"] == 0, report["mismatches"]
    assert report["ok"] == report["requests"] >= 64  # every client finished at least one request
    assert report["latency_ms"]["p50"] > 0 and report["latency_ms"]["p99"] >= report["latency_ms"]["p50"]
    assert rel_server.llm_handle().spec_decode_metrics.remote().result()["num_drafts"] > drafts_before
    rel_server.wait_idle()


def test_load_test_cli_checks_against_concurrency_one(rel_server, tmp_path):
    """``python -m bench.load_test --check-exact``: references from the same app at concurrency 1."""
    from bench.load_test import main

    out = tmp_path / "load.json"
    argv = ["--url", rel_server.base_url, "--model", rel_server.model, "--api-key", rel_server.api_key]
    argv += [
        "--concurrency",
        "4",
        "--duration-s",
        "3",
        "--max-tokens",
        "8",
        "--check-exact",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["ok"] == report["requests"] >= 4 and report["config"]["references"] is True
    assert report["config"]["api_key"] == "***"
    assert set(report["latency_ms"]) >= {"p50", "p99"}
