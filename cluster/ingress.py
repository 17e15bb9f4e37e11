"""OpenAIIngress: the HTTP front (FastAPI on Ray Serve) of the OpenAI-compatible API.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE ``data: {...}`` ... ``data:
[DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``. The ingress
validates requests (pydantic), forwards them to an ``LLMServer`` replica through a streaming deployment
handle, and maps every failure to OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``:
400 invalid input (also for what FastAPI would answer 422), 401 missing or wrong API key (when one is
configured), 404 unknown model or route, 413 body too large, 503/429 + ``Retry-After`` when the replicas'
queues are full, 503 when the engine is down. A request that meets a dead or restarting engine before any
token reached the client is retried until ``ingress.engine_retry_timeout_s`` (Serve replaces the replica
meanwhile); one that already streamed tokens ends with an SSE error event. A client that disconnects cancels
its request, which aborts the engine sequences and frees their KV blocks.

No ``from __future__ import annotations`` here: Serve rebuilds the route signatures and FastAPI must see real
types (``Request``), not strings.
"""

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from cluster.errors import (
    OverloadedError,
    RequestTooLargeError,
    error_body,
    error_from_exception,
    error_from_validation,
    validation_param_and_message,
)
from cluster.metrics import ServerMetrics
from cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from configs.serve import IngressArgs, ServeArgs
from flexspec.errors import FlexspecError, InvalidRequestError, ModelNotFoundError

log = logging.getLogger(__name__)

API_KEY_ENV = "FLEXSPEC_API_KEY"

app = FastAPI(title="flexspec", description="OpenAI-compatible API with speculative decoding")


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    param, text = validation_param_and_message(list(exc.errors()))
    return JSONResponse(error_body(text, "invalid_request_error", param), 400)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    code = "not_found" if exc.status_code == 404 else None  # OpenAI codes are strings (or null)
    return JSONResponse(error_body(str(exc.detail), type_, None, code), exc.status_code)


def _error_response(status: int, body: dict[str, Any], retry_after_s: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(int(retry_after_s))} if retry_after_s is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


class ApiKeyAuth:
    """``Authorization: Bearer <key>`` check, constant time (``hmac.compare_digest``).

    Args:
        key: the expected key; None or empty = no authentication.
    """

    def __init__(self, key: str | None) -> None:
        self._key = key.encode("utf-8") if key else None

    @classmethod
    def from_config(cls, args: IngressArgs) -> "ApiKeyAuth":
        """The configured ``ingress.api_key``, else ``FLEXSPEC_API_KEY`` from this process's environment."""
        key = args.api_key.get_secret_value() if args.api_key is not None else os.environ.get(API_KEY_ENV)
        return cls(key)

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def reject(self, request: Request) -> JSONResponse | None:
        """None when the request may pass, else the 401 response (OpenAI's shape and code)."""
        if self._key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest on bytes of any length; the length check leaks only the key's length
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"), self._key):
            return None
        body = error_body(
            "Invalid or missing API key: send the header 'Authorization: Bearer <key>'.",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class _EngineUnavailable(Exception):
    """The engine replica is dead or being replaced, and nothing was sent to the client yet (retryable)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.body = body


def _unavailable(cause: object) -> _EngineUnavailable:
    return _EngineUnavailable(error_body(f"engine unavailable: {cause}", "engine_unavailable"))


def _reject_constant(name: str) -> float:
    raise InvalidRequestError(f"request body is not valid JSON: {name} is not a JSON number")


def _carries_output(chunk: dict[str, Any]) -> bool:
    """True for chunks the client must see as they come: tokens, finish reasons, usage or an error."""
    if "error" in chunk or not chunk.get("choices"):
        return True
    for c in chunk["choices"]:
        delta = c.get("delta")
        text = delta.get("content") if delta is not None else c.get("text")
        if text or c.get("finish_reason") or c.get("logprobs"):
            return True
    return False


class _SSEResponse(StreamingResponse):
    """An SSE stream that ends quietly when its client goes away.

    When a client disconnects, Serve's proxy cancels the ingress's pending fetch of the request's ASGI
    messages, and Serve's receive proxy hands that cancellation (``ray.exceptions.TaskCancelledError``) to
    ``receive()`` instead of an ``http.disconnect`` message. Raised out of Starlette's disconnect listener it
    failed the response, and the failed call was left to the garbage collector with nobody to read its
    exception: asyncio logged "Future exception was never retrieved ... TaskCancelledError" (or "Task
    exception ..."). Here it counts as the disconnect it is: the listener returns, Starlette cancels the
    body iterator and ``_stream``'s ``finally`` cancels the engine request (which frees its KV blocks).
    """

    media_type = "text/event-stream"

    async def listen_for_disconnect(self, receive: Receive) -> None:
        try:
            await super().listen_for_disconnect(receive)
        except RayError as e:  # TaskCancelledError, or the proxy actor gone: the client is unreachable
            log.debug("client channel closed (%s): treated as a disconnect", type(e).__name__)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _chain(head: list[dict[str, Any]], gen: Any) -> AsyncIterator[dict[str, Any]]:
    for chunk in head:
        yield chunk
    async for chunk in gen:
        yield chunk


def _merge_choice(acc: dict[str, Any], c: dict[str, Any]) -> None:
    """Accumulate one streamed choice delta into ``acc`` (text, logprobs, finish_reason)."""
    if "delta" in c:
        acc["text"] = acc.get("text", "") + (c["delta"].get("content") or "")
    else:
        acc["text"] = acc.get("text", "") + c.get("text", "")
    lp = c.get("logprobs")
    if lp is not None:
        prev = acc.setdefault("logprobs", {})
        for k, v in lp.items():
            prev.setdefault(k, []).extend(v)
    if c.get("finish_reason"):
        acc["finish_reason"] = c["finish_reason"]


def _final_choice(acc: dict[str, Any], chat: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": acc["index"],
        "logprobs": acc.get("logprobs"),
        "finish_reason": acc.get("finish_reason"),
    }
    if chat:
        out["message"] = {"role": "assistant", "content": acc.get("text", "")}
    else:
        out["text"] = acc.get("text", "")
    return out


@serve.ingress(app)
class OpenAIIngress:
    """Args: ``llm``: handle to the ``LLMServer`` deployment; ``args``: the application's ``ServeArgs``."""

    def __init__(self, llm: Any, args: ServeArgs | dict) -> None:
        self.llm = llm
        self.args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
        self.model_name = self.args.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.created = int(time.time())
        self.auth = ApiKeyAuth.from_config(self.args.ingress)

    # ---- info routes ----------------------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "flexspec",
            "root": self.args.engine.model,
            "max_model_len": self.args.engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models(self, request: Request) -> Any:
        if (denied := self.auth.reject(request)) is not None:
            return denied
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Any:
        """OpenAI's model retrieval (``client.models.retrieve``): the served model's card, else 404."""
        if (denied := self.auth.reject(request)) is not None:
            return denied
        if model != self.model_name:
            err = ModelNotFoundError(
                f"The model '{model}' does not exist; this server serves '{self.model_name}'.", param="model"
            )
            return _error_response(*error_from_exception(err))
        return self._model_card()

    @app.get("/health")
    async def health(self) -> Response:
        """200 when an engine replica answers and its loop runs, else 503."""
        try:
            stats = await asyncio.wait_for(self.llm.stats.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001 - any failure means not ready
            return _error_response(
                503, error_body(f"engine unavailable: {type(e).__name__}", "engine_unavailable")
            )
        self.metrics.engines.update(stats)
        if not stats.get("healthy", False):
            return _error_response(503, error_body("engine loop is not running", "engine_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        if self.args.ingress.metrics_require_api_key and (denied := self.auth.reject(request)) is not None:
            return denied
        try:  # refresh one replica's gauges; the others come with their finished requests
            self.metrics.engines.update(await asyncio.wait_for(self.llm.stats.remote(), timeout=5))
        except Exception:
            log.debug("engine stats unavailable at scrape", exc_info=True)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ---- generation routes ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, "chat")

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "completion")

    async def _generate(self, request: Request, schema: type[SamplingRequest], method: str) -> Response:
        if (denied := self.auth.reject(request)) is not None:
            return denied  # before reading the body
        tracker = self.metrics.tracker()
        try:
            body = await self._read_json(request)
            req = schema.model_validate(body)
            if req.model != self.model_name:
                raise ModelNotFoundError(
                    f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                    param="model",
                )
            req.check_supported()
            limit = req.requested_max_tokens()
            req.sampling_params(
                max_tokens=1 if limit is None else limit
            )  # ranges checked here, before a replica is busy
        except ValidationError as e:
            return _error_response(*error_from_validation(e))
        except FlexspecError as e:
            return _error_response(*error_from_exception(e))

        retry_after = self.args.deployment.retry_after_s
        deadline = time.monotonic() + self.args.ingress.engine_retry_timeout_s
        while True:
            try:
                try:
                    gen, head = await self._start(method, body)
                except BackPressureError as e:
                    err = OverloadedError(str(e), e.status_code, e.retry_after_s)
                    retry = e.retry_after_s if e.retry_after_s is not None else retry_after
                    return _error_response(*error_from_exception(err), retry_after_s=retry)
                if "error" in head[-1] and head[-1]["error"]["type"] != "engine_unavailable":
                    gen.cancel()
                    return _error_response(head[-1]["status"], {"error": head[-1]["error"]})
                if "error" in head[-1]:
                    gen.cancel()
                    raise _EngineUnavailable({"error": head[-1]["error"]})
                if req.stream:
                    return _SSEResponse(self._stream(gen, head, req, tracker))
                return await self._collect(gen, head, tracker, req.num_choices)
            except _EngineUnavailable as e:
                wait = max(1.0, float(retry_after))
                if time.monotonic() + wait > deadline:
                    return _error_response(503, e.body, retry_after_s=retry_after)
                log.warning("%s; retrying in %.0fs (nothing was sent to the client yet)", e, wait)
                await asyncio.sleep(wait)

    async def _start(self, method: str, body: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        """Call the replica; read its chunks up to the first that carries output (or an error), so that a
        failure before any token is still retryable and an invalid request still gets its HTTP status.

        Raises:
            BackPressureError: every replica's queue is full.
            _EngineUnavailable: the replica died or is gone.
        """
        gen = None
        head: list[dict[str, Any]] = []
        try:
            gen = getattr(self.llm.options(stream=True), method).remote(body)
            while not head or not _carries_output(head[-1]):
                head.append(await gen.__anext__())
        except BackPressureError:  # raised by .remote() itself or by the first item
            raise
        except StopAsyncIteration:
            raise _unavailable("the replica ended the stream without output") from None
        except asyncio.CancelledError:  # the client went away while waiting for the first token
            if gen is not None:
                gen.cancel()
            raise
        except Exception as e:  # the replica died or is gone
            if gen is not None:
                gen.cancel()
            raise _unavailable(type(e).__name__) from e
        return gen, head

    async def _stream(
        self, gen: Any, head: list[dict[str, Any]], req: SamplingRequest, tracker: Any
    ) -> AsyncIterator[str]:
        """SSE: every chunk as ``data: {...}``; usage chunk if asked; ``data: [DONE]``. An engine that fails
        after tokens were sent ends the stream with an error event (OpenAI's error shape). A client that
        leaves counts its unfinished choices as ``finished_reason="abort"`` (vLLM's metric)."""
        include_usage = req.include_usage
        finished = False
        reasons: list[str | None] = []
        try:
            try:
                async for chunk in _chain(head, gen):
                    if "error" in chunk:
                        yield _sse({"error": chunk["error"]})
                        break
                    if not chunk["choices"] and "usage" in chunk:
                        self._usage_chunk(chunk, tracker, reasons)
                        if include_usage:
                            yield _sse(chunk)
                        continue
                    tracker.on_chunk(chunk)
                    reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
                    if include_usage:
                        chunk.setdefault("usage", None)  # usage so far with continuous_usage_stats
                    yield _sse(chunk)
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream
                log.warning("engine failed mid-stream: %s", type(e).__name__)
                yield _sse(error_body(f"engine unavailable: {type(e).__name__}", "engine_unavailable"))
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                gen.cancel()  # client went away: the replica aborts the sequences and frees their KV blocks
                tracker.on_abort(req.num_choices - len(reasons))

    async def _collect(
        self, gen: Any, head: list[dict[str, Any]], tracker: Any, num_choices: int
    ) -> Response:
        """Merge the chunk stream into one ``chat.completion`` / ``text_completion`` response. A client that
        leaves first counts its ``num_choices`` less the finished ones as ``finished_reason="abort"``.

        Raises:
            _EngineUnavailable: the engine failed before the response was complete (nothing was sent).
        """
        choices: dict[int, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        usage: dict[str, int] = {}
        finished = False
        try:
            try:
                async for chunk in _chain(head, gen):
                    if "error" in chunk:
                        if chunk["error"]["type"] == "engine_unavailable":
                            raise _EngineUnavailable({"error": chunk["error"]})
                        return _error_response(chunk["status"], {"error": chunk["error"]})
                    top = {k: chunk[k] for k in ("id", "object", "created", "model")}
                    if not chunk["choices"] and "usage" in chunk:
                        usage = self._usage_chunk(
                            chunk, tracker, [c.get("finish_reason") for c in choices.values()]
                        )
                        continue
                    tracker.on_chunk(chunk)
                    for c in chunk["choices"]:
                        _merge_choice(choices.setdefault(c["index"], {"index": c["index"]}), c)
            except _EngineUnavailable:
                raise
            except asyncio.CancelledError:  # the client went away
                tracker.on_abort(num_choices - sum(bool(c.get("finish_reason")) for c in choices.values()))
                raise
            except Exception as e:  # the replica died mid-request
                raise _unavailable(type(e).__name__) from e
            finished = True
        finally:
            if not finished:
                gen.cancel()
        chat = top.get("object") == "chat.completion.chunk"
        top["object"] = "chat.completion" if chat else "text_completion"
        out = [_final_choice(choices[i], chat) for i in sorted(choices)]
        return JSONResponse(top | {"choices": out, "usage": usage})

    def _usage_chunk(self, chunk: dict[str, Any], tracker: Any, reasons: list[str | None]) -> dict[str, int]:
        engine = chunk.pop("_engine", None)
        if engine:
            self.metrics.engines.update(engine)
        tracker.on_finish(chunk["usage"], reasons)
        return chunk["usage"]

    async def _read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object; 413 past ``max_request_bytes`` (checked while reading), 400 if not JSON."""
        limit = self.args.ingress.max_request_bytes
        too_large = RequestTooLargeError(f"request body exceeds {limit} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        try:
            body = json.loads(b"".join(parts), parse_constant=_reject_constant)
        except InvalidRequestError:
            raise
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise InvalidRequestError(f"request body is not valid JSON: {reason}") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        return body
