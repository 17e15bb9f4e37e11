"""A multi-megabyte prompt gets the 400 ``context_length_exceeded`` at once, before it is tokenized (it used to
take ~8 s of tokenizing on the replica); prompts that fit still run, also long ones of few tokens.

Its own app: the shared one (tests/cluster/conftest.py) takes bodies up to 64 KiB only; this one takes the
default 8 MiB.
"""

from __future__ import annotations

import time

import httpx
import pytest
from transformers import AutoTokenizer

from flexspec.models.loader import resolve_model_dir
from tests.cluster.conftest import APP_ARGS, MODEL_NAME, deploy
from tests.conftest import DEFAULT_MODEL

MAX_MODEL_LEN = APP_ARGS["engine"]["max_model_len"]
HUGE = "hello world " * 450_000  # 5.4 MB; ~900k tokens


@pytest.fixture(scope="module")
def big_server(ray_session):
    from ray import serve

    args = APP_ARGS | {"ingress": {"max_request_bytes": 8 * 2**20}}
    server = deploy(args, "flexspec-long-prompt", MODEL_NAME)
    # the first request of a fresh replica pays one-time costs; not what is measured here
    r = httpx.post(f"{server.api}/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 1},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    yield server
    serve.shutdown()


def _post_timed(server, path: str, body: dict) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    resp = httpx.post(f"{server.api}{path}", json=body, timeout=120)
    return resp, time.perf_counter() - t0


def _assert_too_long(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        param,
    )
    assert err["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens; the prompt"
    )
    assert "which leaves no room for output" in err["message"]


def test_multi_megabyte_prompts_are_rejected_at_once(big_server):
    m = big_server.model
    cases = [
        ("/completions", {"model": m, "prompt": HUGE, "max_tokens": 4}, "prompt"),
        ("/completions", {"model": m, "prompt": ["Hi", HUGE]}, "prompt"),
        ("/chat/completions", {"model": m, "messages": [{"role": "user", "content": HUGE}]}, "messages"),
        (
            "/chat/completions",
            {"model": m, "messages": [{"role": "user", "content": HUGE}], "stream": True},
            "messages",
        ),
    ]
    for path, body, param in cases:
        resp, seconds = _post_timed(big_server, path, body)
        _assert_too_long(resp, param)
        assert seconds < 2.0, f"{path}: {seconds:.2f}s"
        assert "at least" in resp.json()["error"]["message"]  # the early check answered, not the tokenizer


def test_prompts_that_fit_still_run(big_server):
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    m = big_server.model
    resp, _ = _post_timed(
        big_server,
        "/chat/completions",
        {
            "model": m,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text
    # 40,000 characters in 500 tokens: far more characters than max_model_len, yet it fits
    long_few_tokens = "#" * 80 * 500
    n = len(tok.encode(long_few_tokens))
    assert len(long_few_tokens) > MAX_MODEL_LEN * 20 and n < MAX_MODEL_LEN
    resp, _ = _post_timed(
        big_server, "/completions", {"model": m, "prompt": long_few_tokens, "max_tokens": 1}
    )
    assert resp.status_code == 200, resp.text[:500]
    assert resp.json()["usage"]["prompt_tokens"] == n


def test_too_long_prompts_under_the_bound_get_the_exact_count(big_server):
    """Past max_model_len but under the character bound: tokenized, refused with the exact token count."""
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL))
    prompt = "hello " * 2000
    resp, _ = _post_timed(big_server, "/completions", {"model": big_server.model, "prompt": prompt})
    _assert_too_long(resp, "prompt")
    assert f"the prompt has {len(tok.encode(prompt))} tokens" in resp.json()["error"]["message"]
