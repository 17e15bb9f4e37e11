"""One real Serve app on loopback for the whole module set: ingress + LLMServer (TP=1, ngram speculation).

``ray_session`` (the shared local Ray cluster) is in tests/conftest.py.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

from tests.conftest import DEFAULT_MODEL

MODEL_NAME = "smollm2-test"

APP_ARGS = {
    "model": DEFAULT_MODEL,
    "served_model_name": MODEL_NAME,
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
    "engine": {"device": "cpu", "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024},
    "cpus_per_worker": 2,
    "deployment": {"max_ongoing_requests": 8, "max_queued_requests": 8, "retry_after_s": 2},
    "ingress": {"max_request_bytes": 65536},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    model: str
    app: str = ""  # Serve application name

    def llm_handle(self):
        """Deployment handle of the app's engine replicas (``LLMServer``)."""
        from ray import serve

        return serve.get_deployment_handle("LLMServer", app_name=self.app)

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"


def deploy(args: dict, name: str, model: str) -> Server:
    """Start Serve on a free loopback port and deploy ``cluster.app:build_app(args)`` (what a config names)."""
    from ray import serve

    from cluster.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=name, route_prefix="/")
    return Server(f"http://127.0.0.1:{port}", model, name)


@pytest.fixture(scope="module")
def server(ray_session):
    """The TP=1 app, shared by a test module; shut down (CPUs freed) when the module is done."""
    from ray import serve

    yield deploy(APP_ARGS, "flexspec-test", MODEL_NAME)
    serve.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    # Ray Serve's own pydantic models trigger these on import; they are not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:ray.*")
    config.addinivalue_line("filterwarnings", "ignore:.*extra keyword arguments on `Field`.*")


@pytest.fixture(scope="package", autouse=True)
def _single_torch_thread():
    """Reference engines in this process run on one torch thread, restored afterwards.

    The Ray workers / Serve replica of these tests already use the 2 cores; with 2 OpenMP threads the
    in-process reference was measured 10-20x slower on a busy 2-core machine (barrier waits), 1 thread is not.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
