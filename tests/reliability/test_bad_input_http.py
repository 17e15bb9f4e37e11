"""Bad input over HTTP against the real Serve app (issue 9, item 1): every case gets OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` with the right status (and param / code where they mean
something), and the server answers a valid request right after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.conftest import MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL_NAME

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
M = MODEL_NAME
MSGS = [{"role": "user", "content": "hi"}]


@dataclass
class Case:
    id: str
    path: str
    body: object = None  # sent as JSON unless ``raw`` is given
    raw: bytes | None = None
    status: int = 400
    param: str | None = None  # exact param, or a prefix when it ends with "*"
    code: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    message: str | None = None  # a part of the error message


def chat(**kw) -> dict:
    return {"model": M, "messages": MSGS} | kw


def comp(**kw) -> dict:
    return {"model": M, "prompt": "hi"} | kw


CASES = [
    # ---- not JSON / not an object ----
    Case("invalid_json", CHAT, raw=b'{"model": '),
    Case("json_trailing_garbage", CHAT, raw=json.dumps(chat()).encode() + b" trailing"),
    Case("empty_body", CHAT, raw=b""),
    Case("body_is_array", CHAT, [1, 2]),
    Case("body_is_string", CHAT, "hello"),
    Case("body_is_null", CHAT, raw=b"null"),
    Case("nan_constant", CHAT, raw=f'{{"model": "{M}", "messages": [], "temperature": NaN}}'.encode()),
    Case("infinity_constant", COMP, raw=f'{{"model": "{M}", "prompt": "a", "top_p": Infinity}}'.encode()),
    Case("nested_too_deep", COMP, raw=b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}"),
    Case(
        "non_utf8_bytes",
        CHAT,
        raw=b'{"model": "' + M.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe\xfa"}]}',
    ),
    Case("latin1_body", COMP, raw=f'{{"model": "{M}", "prompt": "caf\xe9"}}'.encode("latin-1")),
    Case(
        "lone_surrogate_text",
        CHAT,
        raw=b'{"model": "' + M.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}',
        param="messages*",
    ),
    # ---- model / messages ----
    Case("missing_model", CHAT, {"messages": MSGS}, param="model"),
    Case("model_wrong_type", CHAT, chat(model=123), param="model"),
    Case(
        "unknown_model", CHAT, chat(model="no-such-model"), status=404, param="model", code="model_not_found"
    ),
    Case("missing_messages", CHAT, {"model": M}, param="messages"),
    Case("empty_messages", CHAT, chat(messages=[]), param="messages"),
    Case("messages_not_a_list", CHAT, chat(messages="hi"), param="messages"),
    Case(
        "message_bad_role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), param="messages.0.role"
    ),
    Case("message_missing_role", CHAT, chat(messages=[{"content": "x"}]), param="messages.0.role"),
    Case(
        "content_wrong_type",
        CHAT,
        chat(messages=[{"role": "user", "content": 42}]),
        param="messages.0.content",
        message="messages.0.content: expected a string or a list of text parts",
    ),
    Case(
        "user_content_null",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        param="messages.0.content",
        message="content is required for role 'user'",
    ),
    Case(
        "text_part_without_text",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        param="messages.0.content.0.text",
    ),
    Case(
        "image_content_part",
        CHAT,
        chat(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        ),
        param="messages.0.content",
        message="content parts of type 'image_url' are not supported",
    ),
    Case(
        "continue_final_message_with_generation_prompt",
        CHAT,
        chat(messages=MSGS + [{"role": "assistant", "content": "He"}], continue_final_message=True),
        param="continue_final_message",
    ),
    Case(
        "continue_final_message_after_user",
        CHAT,
        chat(continue_final_message=True, add_generation_prompt=False),
        param="continue_final_message",
        message="last message to be the assistant's",
    ),
    # ---- max_tokens ----
    Case("max_tokens_zero", CHAT, chat(max_tokens=0), param="max_tokens"),
    Case("max_tokens_negative", COMP, comp(max_tokens=-5), param="max_tokens"),
    Case("max_tokens_string", CHAT, chat(max_tokens="ten"), param="max_tokens"),
    Case("max_tokens_fraction", CHAT, chat(max_tokens=1.5), param="max_tokens"),
    Case(
        "max_tokens_over_context",
        COMP,
        comp(max_tokens=10**6),
        param="max_tokens",
        code="context_length_exceeded",
    ),
    Case("max_completion_tokens_zero", CHAT, chat(max_completion_tokens=0), param="max_completion_tokens"),
    Case(
        "prompt_plus_max_tokens_over",
        CHAT,
        chat(max_tokens=MAX_MODEL_LEN),
        param="max_tokens",
        code="context_length_exceeded",
    ),
    # ---- sampling ranges ----
    Case("temperature_negative", CHAT, chat(temperature=-0.5), param="temperature"),
    Case("temperature_too_high", CHAT, chat(temperature=101), param="temperature"),
    Case("temperature_string", CHAT, chat(temperature="hot"), param="temperature"),
    Case("top_p_zero", CHAT, chat(top_p=0), param="top_p"),
    Case("top_p_above_one", COMP, comp(top_p=1.5), param="top_p"),
    Case("top_p_negative", CHAT, chat(top_p=-0.1), param="top_p"),
    Case("top_k_below_minus_one", CHAT, chat(top_k=-2), param="top_k"),
    Case("n_zero", CHAT, chat(n=0), param="n"),
    Case("n_over_limit", CHAT, chat(n=17), param="n"),
    Case("n_huge_integer", COMP, comp(n=10**30), param="n"),
    Case("seed_string", COMP, comp(seed="abc"), param="seed"),
    Case("user_wrong_type", CHAT, chat(user=5), param="user"),
    # ---- stop ----
    Case("stop_list_huge", CHAT, chat(stop=["x"] * 1000), param="stop"),
    Case("stop_string_too_long", CHAT, chat(stop="y" * 300), param="stop"),
    Case("stop_empty_string", COMP, comp(stop=""), param="stop"),
    Case(
        "stop_wrong_type",
        COMP,
        comp(stop=5),
        param="stop",
        message="stop: expected a string or a list of strings",
    ),
    Case("stop_token_ids_huge", COMP, comp(stop_token_ids=list(range(1000))), param="stop_token_ids"),
    # ---- logprobs / unsupported features ----
    Case("top_logprobs_out_of_range", CHAT, chat(logprobs=True, top_logprobs=50), param="top_logprobs"),
    Case("top_logprobs_without_logprobs", CHAT, chat(top_logprobs=2), param="top_logprobs"),
    Case("completion_logprobs_over_20", COMP, comp(logprobs=21), param="logprobs"),
    Case(
        "stream_options_without_stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    Case("tools_unsupported", CHAT, chat(tools=[{"type": "function"}]), param="tools"),
    Case("presence_penalty_unsupported", CHAT, chat(presence_penalty=1.0), param="presence_penalty"),
    Case("logit_bias_unsupported", CHAT, chat(logit_bias={"1": 5}), param="logit_bias"),
    Case(
        "response_format_json", CHAT, chat(response_format={"type": "json_object"}), param="response_format"
    ),
    Case("echo_unsupported", COMP, comp(echo=True), param="echo"),
    Case("min_tokens_unsupported", COMP, comp(min_tokens=5), param="min_tokens"),
    Case(
        "include_stop_str_unsupported",
        CHAT,
        chat(stop=["."], include_stop_str_in_output=True),
        param="include_stop_str_in_output",
    ),
    Case("best_of_unsupported", COMP, comp(best_of=3), param="best_of"),
    # ---- prompts ----
    Case("missing_prompt", COMP, {"model": M}, param="prompt"),
    Case("empty_prompt_list", COMP, comp(prompt=[]), param="prompt"),
    Case("empty_prompt_string", COMP, comp(prompt=""), param="prompt"),
    Case("token_id_out_of_vocab", COMP, comp(prompt=[999_999_999]), param="prompt"),
    Case("negative_token_id", COMP, comp(prompt=[-1]), param="prompt"),
    Case(
        "prompt_mixed_types",
        COMP,
        comp(prompt=[1, "a"]),
        param="prompt",
        message="prompt: expected a string, ",
    ),
    Case("too_many_prompts", COMP, comp(prompt=["a"] * 100, n=2), param="prompt"),
    Case(
        "prompt_ids_at_max_model_len",
        COMP,
        comp(prompt=[28] * MAX_MODEL_LEN),
        param="prompt",
        code="context_length_exceeded",
    ),
    Case(
        "prompt_text_over_context",
        COMP,
        comp(prompt="hello " * 2000),
        param="prompt",
        code="context_length_exceeded",
    ),
    Case(
        "chat_over_context",
        CHAT,
        chat(messages=[{"role": "user", "content": "hello " * 2000}]),
        param="messages",
        code="context_length_exceeded",
    ),
    # ---- size limits, routes ----
    Case(
        "oversized_body",
        COMP,
        comp(prompt="x" * (MAX_REQUEST_BYTES + 10)),
        status=413,
        code="request_too_large",
    ),
    Case("oversized_chunked_body", COMP, raw=b"chunked", status=413, code="request_too_large"),
    Case("unknown_route", "/v1/nothing-here", chat(), status=404, code="not_found"),
    Case("wrong_http_method", CHAT, method="GET", status=405),
    Case(
        "retrieve_unknown_model",
        "/v1/models/no-such-model",
        method="GET",
        status=404,
        param="model",
        code="model_not_found",
    ),
]


def _chunks(data: bytes, size: int = 8192) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _send(server, case: Case) -> httpx.Response:
    url = f"{server.base_url}{case.path}"
    headers = server.headers | {"Content-Type": "application/json"} | case.headers
    if case.method == "GET":
        return httpx.get(url, headers=headers, timeout=60)
    if case.raw == b"chunked":  # no Content-Length: the limit must hold while reading
        data = json.dumps(comp(prompt="z" * (2 * MAX_REQUEST_BYTES))).encode()
        return httpx.post(url, content=_chunks(data), headers=headers, timeout=60)
    content = case.raw if case.raw is not None else json.dumps(case.body).encode()
    return httpx.post(url, content=content, headers=headers, timeout=60)


def assert_openai_error(
    resp: httpx.Response, status: int, param: str | None, code: str | None, message: str | None = None
) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] is None or isinstance(err["code"], str)  # OpenAI's codes are strings
    if param is not None:
        if param.endswith("*"):
            assert (err["param"] or "").startswith(param[:-1]), err
        else:
            assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if message is not None:
        assert message in err["message"], err
    return err


def test_table_has_enough_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_openai_error_and_server_keeps_serving(rel_server, case):
    err = assert_openai_error(_send(rel_server, case), case.status, case.param, case.code, case.message)
    if case.status == 400:
        assert err["type"] == "invalid_request_error"
    rel_server.valid_request()


def test_nothing_left_behind_after_bad_inputs(rel_server):
    """Rejected requests leave no sequence or KV block behind (runs after the table in file order)."""
    rel_server.wait_idle()
    rel_server.valid_request()
