"""Security (issue 9, item 6) against the real Serve app: API key (``Authorization: Bearer``, 401 in OpenAI's
shape otherwise, /health open, /metrics configurable), the key never printed, checkpoint code never run, and
prompts never in the logs unless ``log_requests`` is on (``test_worker_failure.py`` checks the "on" side)."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from starlette.requests import Request

from cluster.ingress import ApiKeyAuth
from configs import EngineConfig
from configs.serve import IngressArgs, ServeArgs
from tests.reliability.conftest import API_KEY, APP_ARGS
from tests.reliability.test_bad_input_http import assert_openai_error


def _request(authorization: str | None) -> Request:
    headers = [(b"authorization", authorization.encode("latin-1"))] if authorization is not None else []
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


BAD_AUTH = [
    None,
    "",
    "Bearer",
    f"Basic {API_KEY}",
    f"Bearer {API_KEY[:-1]}",
    f"Bearer {API_KEY}x",
    f"Bearer {API_KEY.upper()}",
    f"Token {API_KEY}",
    "Bearer sk-\u00e9t\u00e9",
]


@pytest.mark.parametrize("authorization", BAD_AUTH)
def test_wrong_or_missing_key_gets_401_in_openai_shape(rel_server, authorization):
    headers = {"Authorization": authorization.encode("latin-1")} if authorization is not None else {}
    body = {"model": rel_server.model, "prompt": "hi", "max_tokens": 1}
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
    ):
        r = httpx.request(method, f"{rel_server.base_url}{path}", json=body, headers=headers, timeout=60)
        err = assert_openai_error(r, 401, None, "invalid_api_key")
        assert API_KEY not in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{rel_server.base_url}/metrics", headers=headers, timeout=60)  # metrics_require_api_key
    assert_openai_error(r, 401, None, "invalid_api_key")


def test_right_key_passes_and_health_stays_open(rel_server):
    assert httpx.get(f"{rel_server.base_url}/health", timeout=60).status_code == 200  # no key needed
    client = openai.OpenAI(base_url=rel_server.api, api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [rel_server.model]
    r = client.completions.create(model=rel_server.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    r = httpx.get(f"{rel_server.base_url}/metrics", headers=rel_server.headers, timeout=60)
    assert r.status_code == 200 and "vllm:num_requests_running" in r.text
    with pytest.raises(openai.AuthenticationError):  # what the official SDK raises on our 401
        openai.OpenAI(base_url=rel_server.api, api_key="sk-wrong", max_retries=0).models.list()


def test_api_key_sources(monkeypatch):
    monkeypatch.delenv("FLEXSPEC_API_KEY", raising=False)
    assert not ApiKeyAuth.from_config(IngressArgs()).enabled  # default: no key
    assert ApiKeyAuth(None).reject(_request(None)) is None
    monkeypatch.setenv("FLEXSPEC_API_KEY", "from-env")
    env = ApiKeyAuth.from_config(IngressArgs())
    assert env.reject(_request("Bearer from-env")) is None
    assert env.reject(_request("bearer   from-env ")) is None  # scheme is case-insensitive
    assert env.reject(_request("Bearer other")).status_code == 401
    configured = ApiKeyAuth.from_config(IngressArgs(api_key="from-config"))  # the config wins over the env
    assert configured.reject(_request("Bearer from-config")) is None
    assert configured.reject(_request("Bearer from-env")).status_code == 401


def test_api_key_is_never_printed():
    args = ServeArgs.model_validate(APP_ARGS)
    assert args.ingress.api_key.get_secret_value() == API_KEY
    for text in (repr(args), str(args), args.model_dump_json(), str(args.model_dump())):
        assert API_KEY not in text


def test_checkpoint_code_is_never_run(engine, tmp_path):
    """A checkpoint whose config / tokenizer point at its own Python files (``auto_map``): loading it must
    not import them (``trust_remote_code`` is off by default, and the loader builds models from our own
    registry)."""
    assert EngineConfig().trust_remote_code is False and ServeArgs().engine.trust_remote_code is False
    marker = tmp_path / "code-ran"
    src = Path(engine.executor.model_dir)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (folder / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, folder / f.name)
    evil = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "modeling_evil.py").write_text(evil + "class EvilModel:\n    pass\n")
    (folder / "tokenization_evil.py").write_text(evil + "class EvilTokenizer:\n    pass\n")
    for name, auto_map in (
        ("config.json", {"AutoModelForCausalLM": "modeling_evil.EvilModel"}),
        ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}),
    ):
        cfg = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(cfg | {"auto_map": auto_map}))

    from flexspec.engine.llm_engine import LLMEngine

    loaded = LLMEngine(EngineConfig(model=str(folder), device="cpu", max_model_len=64))
    assert not marker.exists()
    assert type(loaded.tokenizer).__name__ != "EvilTokenizer"
    loaded.shutdown()


def _log_files() -> list[Path]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return [p for p in logs.rglob("*") if p.is_file() and p.suffix in (".log", ".out", ".err")]


def test_logs_never_contain_prompts(rel_server):
    """Requests whose prompts carry a unique marker (accepted, rejected, cancelled, streamed): the marker is
    in no log file of the Ray session, while the request lines themselves are there."""
    marker = "MARKER" + secrets.token_hex(8)
    client = openai.OpenAI(base_url=rel_server.api, api_key=API_KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": f"Say {marker} please."}]
    r = client.chat.completions.create(model=rel_server.model, messages=msgs, max_tokens=3, temperature=0)
    list(client.completions.create(model=rel_server.model, prompt=marker, max_tokens=3, stream=True))
    with pytest.raises(openai.BadRequestError):  # rejected in the replica (context length)
        client.completions.create(model=rel_server.model, prompt=marker * 400, max_tokens=1)
    with pytest.raises(openai.BadRequestError):  # rejected at the ingress (range check)
        client.chat.completions.create(model=rel_server.model, messages=msgs, temperature=-1)
    bad = {"model": rel_server.model, "prompt": marker + "\ud800", "max_tokens": 1}  # lone surrogate
    content = json.dumps(bad).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
    assert (
        httpx.post(f"{rel_server.api}/completions", content=content, headers=rel_server.headers).status_code
        == 400
    )
    with httpx.stream(
        "POST",
        f"{rel_server.api}/completions",
        json={
            "model": rel_server.model,
            "prompt": marker,
            "max_tokens": 300,
            "stream": True,
            "ignore_eos": True,
        },
        headers=rel_server.headers,
        timeout=60,
    ) as s:
        next(line for line in s.iter_lines() if line.startswith("data: "))  # then disconnect
    rel_server.wait_idle()

    deadline = time.monotonic() + 30
    while True:  # the request line of the first chat request shows the log is the one requests reach
        texts = {p: p.read_text(errors="replace") for p in _log_files()}
        if any(f"{r.id}: " in t for t in texts.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert any(f"{r.id}: {r.usage.prompt_tokens} prompt + 3 completion tokens" in t for t in texts.values())
    leaks = [str(p) for p, t in texts.items() if marker in t]
    assert not leaks, leaks
