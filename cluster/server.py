"""LLMServer: the engine replica (one per Serve replica): engine + controller loop + OpenAI formatting.

A plain class with a synchronous ``__init__`` so tests can build it without Serve; ``cluster.app`` turns it
into the ``LLMServer`` deployment. Methods return chunk streams as plain dicts (errors included, as
``{"status", "error"}``) so nothing but JSON-able data crosses the replica -> ingress boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from cluster.controller import EngineController
from cluster.errors import to_wire
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from cluster.serving import OpenAIServing
from configs.serve import ServeArgs

log = logging.getLogger(__name__)
# A child of Serve's logger, so request lines land in the replica's Serve log file (Serve configures it).
request_log = logging.getLogger("ray.serve.flexspec.requests")


def build_engine(args: ServeArgs) -> Any:
    """The replica's ``LLMEngine``: in-process for TP=1 ``local``, else over a ``RayExecutor`` worker group.
    Its start-up heap is frozen (``flexspec.engine.gc_heap``): the replica process lives as long as it does."""
    from flexspec.engine.gc_heap import freeze_long_lived
    from flexspec.engine.llm_engine import LLMEngine

    cfg = args.engine
    if args.use_local_executor:
        import torch

        if cfg.device != "cuda":
            torch.set_num_threads(max(1, int(args.cpus_per_worker)))
        engine = LLMEngine(cfg)
        freeze_long_lived()
        return engine

    from actors import RayExecutor, WorkerResources
    from actors.ray_executor import resolve_use_gpu

    resources = WorkerResources(resolve_use_gpu(cfg), args.cpus_per_worker, args.accelerator_type)
    replica = _replica_id()
    executor = RayExecutor(
        cfg,
        resources,
        strategy=args.placement_strategy,
        execute_timeout_s=args.execute_timeout_s,
        name=f"flexspec-tp-{replica}" if replica != "local" else None,
    )
    engine = LLMEngine(cfg, executor=executor)
    freeze_long_lived()
    return engine


class LLMServer:
    """One replica.

    Args:
        args: the application's ``ServeArgs`` (or its dict form).
        engine_factory: builds the engine from ``args`` (tests may inject one).
    """

    def __init__(
        self, args: ServeArgs | dict, engine_factory: Callable[[ServeArgs], Any] = build_engine
    ) -> None:
        self.args = args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args)
        self.engine = engine_factory(self.args)
        self.controller = EngineController(self.engine).start()
        self.serving = OpenAIServing(
            self.controller, self.engine.tokenizer, self.args.model_name, self.args.engine.max_model_len
        )
        self.replica_id = _replica_id()

    async def chat(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks of a chat completion (``request`` is the raw OpenAI JSON body)."""
        async for chunk in self._guard(
            "chat", request, lambda: self.serving.chat(ChatCompletionRequest.model_validate(request))
        ):
            yield chunk

    async def completion(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks of a text completion."""
        async for chunk in self._guard(
            "completion",
            request,
            lambda: self.serving.completion(CompletionRequest.model_validate(request)),
        ):
            yield chunk

    async def _guard(
        self, kind: str, request: dict[str, Any], make: Callable[[], AsyncIterator[dict[str, Any]]]
    ) -> AsyncIterator[dict[str, Any]]:
        """Turn exceptions into one error chunk; attach this engine's snapshot to the usage chunk; log one
        line per request (ids, token counts, status). Prompt and output text reach the log only with
        ``log_requests``; error lines name the exception type and where it was raised, not its message
        (messages may quote user input)."""
        t0 = time.perf_counter()
        rid = f"{kind}-request"
        if self.args.log_requests:
            body = json.dumps(request, ensure_ascii=False)[:100_000]
            request_log.info("%s: %s", kind, body.encode("utf-8", "backslashreplace").decode("utf-8"))
        done = False
        try:
            async for chunk in make():
                rid = chunk.get("id", rid)
                if not chunk["choices"] and "usage" in chunk:
                    chunk["_engine"] = self.stats()
                    u = chunk["usage"]
                    request_log.info(
                        "%s: %d prompt + %d completion tokens in %.2fs",
                        rid,
                        u["prompt_tokens"],
                        u["completion_tokens"],
                        time.perf_counter() - t0,
                    )
                    done = True
                yield chunk
        except Exception as e:
            done = True
            wire = to_wire(e)
            err = wire["error"]
            if wire["status"] >= 500:
                log.error(
                    "%s failed (%d %s): %s at %s",
                    rid,
                    wire["status"],
                    err["type"],
                    type(e).__name__,
                    _where(e),
                    exc_info=e if self.args.log_requests else None,
                )
            else:
                request_log.info(
                    "%s rejected: %d %s (param %s, code %s)",
                    rid,
                    wire["status"],
                    err["type"],
                    err["param"],
                    err["code"],
                )
            yield wire
        finally:
            if not done:  # the caller stopped listening: the engine already aborted the sequences
                request_log.info("%s: cancelled after %.2fs", rid, time.perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        """This engine's snapshot (metrics), tagged with the replica id."""
        return {
            "engine": self.replica_id,
            "healthy": self.controller.healthy,
            **dataclasses.asdict(self.controller.snapshot),
        }

    def spec_decode_metrics(self) -> dict[str, Any] | None:
        """The engine's own speculative-decoding counters (``SpecDecodingMetrics.as_dict``); None without
        speculation. ``/metrics`` exports the same numbers as ``vllm:spec_decode_*``."""
        if getattr(self.engine.config, "speculative_config", None) is None:
            return None
        return self.engine.spec_metrics.as_dict()

    def model_info(self) -> dict[str, Any]:
        return {"model": self.args.engine.model, "max_model_len": self.args.engine.max_model_len}

    async def check_health(self) -> None:
        """Serve's health check: a dead engine loop (e.g. a step failed because a TP rank died) or a TP rank
        that does not answer a ping (dead while idle) raises, and Serve replaces the replica."""
        if not self.controller.healthy:
            raise RuntimeError(f"engine loop is not running: {type(self.controller.error).__name__}")
        ping = getattr(self.engine.executor, "check_health", None)  # RayExecutor; in-process: nothing to ping
        if ping is not None:
            await asyncio.to_thread(ping)

    def shutdown(self) -> None:
        self.controller.stop()
        self.engine.shutdown()

    def __del__(self) -> None:  # Serve calls this when it stops the replica
        try:
            self.shutdown()
        except Exception:
            log.debug("shutdown failed", exc_info=True)


def _where(e: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``e``'s traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve
        return "local"
