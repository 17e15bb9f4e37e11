"""One real Serve app on loopback for the whole package (issue 9): ingress + LLMServer, TP=1 in the replica
process, n-gram speculation, an API key (also on /metrics), small queue limits.

Starting Ray Serve and loading the model costs ~20 s on the 2-core machine, so every module of this package
shares ``rel_server``. The replica reserves 1 CPU (1 torch thread), leaving the other for the worker-failure
module's own app (``test_worker_failure.py``), which is added to the same Serve instance (``serve_http``).
``ray_session`` (the local 2-CPU Ray cluster) and ``engine`` (the in-process reference) are in
tests/conftest.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import pytest

from tests.cluster.conftest import free_port
from tests.conftest import DEFAULT_MODEL

MODEL_NAME = "smollm2-rel"
API_KEY = "sk-flexspec-reliability-7f3a9c2e41d85b60"  # fixed: conftest may be imported twice
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 65536

APP_ARGS = {
    "model": DEFAULT_MODEL,
    "served_model_name": MODEL_NAME,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
    "engine": {
        "device": "cpu",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 1024,
    },
    "cpus_per_worker": 1,
    "deployment": {"max_ongoing_requests": 16, "max_queued_requests": 64, "retry_after_s": 2},
    "ingress": {
        "max_request_bytes": MAX_REQUEST_BYTES,
        "api_key": API_KEY,
        "metrics_require_api_key": True,
    },
}


@dataclass
class RelServer:
    base_url: str  # http://127.0.0.1:PORT[/prefix]
    model: str
    app: str
    api_key: str | None

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def llm_handle(self):
        from ray import serve

        return serve.get_deployment_handle("LLMServer", app_name=self.app)

    def metrics(self) -> dict[str, float]:
        """Engine gauges/counters from /metrics, summed over label sets: {name: value}."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or "{" not in line:
                continue
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is empty; returns the gauges."""
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        deadline = time.monotonic() + timeout_s
        values: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            values = {n: m[n] for n in names if n in m}
            if len(values) == 3 and not any(values.values()):
                return values
            time.sleep(0.5)
        raise AssertionError(f"engine not idle after {timeout_s}s: {values}")

    def valid_request(self) -> dict:
        """One small valid completion; asserts it succeeds (the server still serves)."""
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        r = httpx.post(f"{self.api}/completions", json=body, headers=self.headers, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
        return r.json()


@pytest.fixture(scope="package")
def serve_http(ray_session):
    """Serve on a free loopback port (one instance for the package); shut down at the end."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="package")
def rel_server(serve_http) -> RelServer:
    from ray import serve

    from cluster.app import build_app

    serve.run(build_app(APP_ARGS), name="flexspec-rel", route_prefix="/")
    return RelServer(serve_http, MODEL_NAME, "flexspec-rel", API_KEY)


def pytest_configure(config: pytest.Config) -> None:
    # Ray Serve's own pydantic models trigger these on import; they are not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:ray.*")
    config.addinivalue_line("filterwarnings", "ignore:.*extra keyword arguments on `Field`.*")


@pytest.fixture(scope="package", autouse=True)
def _single_torch_thread():
    """The in-process reference engine runs on one torch thread (the Serve replica uses the other core)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
