"""A real Prometheus server (Debian's ``prometheus``) scrapes the real Serve app's ``/metrics`` on loopback; after
real chat requests with speculation, Prometheus' HTTP API returns spec-decode counters equal to the engine's own
accounting, and every dashboard query evaluates on it."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from cluster.dashboard import build_dashboard, panel_queries
from tests.cluster.conftest import MODEL_NAME, free_port
from tests.cluster.test_openai_server import wait_engine_idle
from tests.ops.promql import interpolate

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus binary not found: install Debian's `prometheus` package (scripts/setup.sh does, as root)",
)
SCRAPE_INTERVAL_S = 1
# Answers that repeat themselves, so n-gram drafts get accepted (measured: ~40% and ~25% acceptance at T=0).
PROMPTS = [
    (
        "Write a Python function add(a, b) that returns a + b, then a function sub(a, b) that returns a - b, "
        "then mul and div in the same style."
    ),
    "List the numbers from 1 to 30, separated by commas.",
]


class Prometheus:
    """One Prometheus process scraping ``target`` every second, with its TSDB in ``storage``."""

    def __init__(self, target: str, storage: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [
                {
                    "job_name": "flexspec",
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": [target]}],
                }
            ],
        }
        config_path = storage / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = storage / "prometheus.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={storage / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"prometheus exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
            )
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout_s}s")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query through the HTTP API; the result vector.

        Raises:
            AssertionError: Prometheus refused the query (the message is its error).
        """
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _chat(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> None:
    messages = [{"role": "user", "content": prompt}]
    if stream:  # streamed: TTFT and inter-token latency series
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, max_tokens=48, temperature=0, stream=True,
        ))  # fmt: skip
        assert any(c.choices and c.choices[0].delta.content for c in chunks)
    else:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
        assert reply.usage.completion_tokens > 0


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Prometheus scraping the app, started after one warm-up request (so every series exists) and returned once
    it has scraped the app twice: later increases show in rate()."""
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    _chat(client, server.model, "Say hello.", stream=True)
    prom = Prometheus(server.base_url.removeprefix("http://"), tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait_ready()
        deadline = time.monotonic() + 30
        while not prom.query('count_over_time(vllm:generation_tokens_total{job="flexspec"}[1m]) >= 2'):
            assert time.monotonic() < deadline, "prometheus did not scrape the app twice in 30 s"
            time.sleep(SCRAPE_INTERVAL_S / 2)
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def traffic(server, prometheus) -> dict[str, Any]:
    """Real chat requests with speculation (ngram) after Prometheus started; the engine's own spec-decode
    accounting once the engine is idle and Prometheus has scraped the final counts."""
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    for i, prompt in enumerate(PROMPTS):
        _chat(client, server.model, prompt, stream=i == 0)
    wait_engine_idle(server)
    want = server.llm_handle().spec_decode_metrics.remote().result()
    deadline = time.monotonic() + 30
    selector = f'{{job="flexspec", model_name="{MODEL_NAME}"}}'
    query = f"vllm:spec_decode_num_drafts_total{selector} == {want['num_drafts']}"
    while not prometheus.query(query):
        assert time.monotonic() < deadline, "Prometheus never scraped the engine's final draft count"
        time.sleep(SCRAPE_INTERVAL_S / 2)
    return want


def _by_position(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"].get("position", ""): float(r["value"][1]) for r in result}


def test_scraped_spec_decode_counters_equal_engine_accounting(prometheus, traffic):
    want = traffic
    assert want["num_drafts"] > 0 and want["num_accepted_tokens"] > 0
    selector = f'{{job="flexspec", model_name="{MODEL_NAME}"}}'

    def scraped(name: str) -> dict[str, float]:
        return _by_position(prometheus.query(f"vllm:spec_decode_{name}_total{selector}"))

    assert scraped("num_drafts") == {"": want["num_drafts"]}
    assert scraped("num_draft_tokens") == {"": want["num_draft_tokens"]}
    assert scraped("num_accepted_tokens") == {"": want["num_accepted_tokens"]}
    per_pos = scraped("num_accepted_tokens_per_pos")
    assert per_pos == {str(i): n for i, n in enumerate(want["num_accepted_tokens_per_pos"])}


def test_every_dashboard_query_evaluates(prometheus, traffic):
    """Prometheus parses and evaluates every panel query (variables filled as Grafana would) and each yields a
    number for the served model: names, labels and PromQL agree with what is scraped, and data flows through."""
    time.sleep(2 * SCRAPE_INTERVAL_S)  # two more samples after the last increase
    values: dict[str, list[float]] = {}
    for title, expr in panel_queries(build_dashboard()):
        result = prometheus.query(interpolate(expr, model_name=MODEL_NAME, rate_interval="5m"))
        finite = [float(r["value"][1]) for r in result if not math.isnan(float(r["value"][1]))]
        assert finite, f"{title}: no finite value from {expr}"
        values.setdefault(title, []).extend(finite)
    k = len(traffic["num_accepted_tokens_per_pos"])
    assert all(0 <= v <= 1 for v in values["Acceptance rate"] + values["Per-position acceptance rate"])
    assert all(1 <= v <= 1 + k for v in values["Mean acceptance length (MAL)"])
    assert max(values["Acceptance rate"]) > 0 and max(values["Mean acceptance length"]) > 1
    assert all(0 < v <= k for v in values["Verification length"])
    assert min(values["Time to first token"]) > 0 and max(values["Token throughput"]) > 0
    assert values["Engine replicas"] == [1.0, 1.0]  # the stat and the time series: one LLMServer replica
