"""EngineController: one replica's scheduling loop around an ``LLMEngine``, with asyncio streams per request.

The engine is single-threaded and stepping blocks for a whole forward, so it lives on one background thread
that alone touches it: requests and aborts arrive through a thread-safe inbox, outputs leave through each
caller's asyncio queue (``loop.call_soon_threadsafe``). Each loop iteration:

    drain inbox (add / abort)  ->  engine.step()  ->  record the step's mode  ->  route outputs to streams

The controller decides nothing about execution: the engine's ``SpeculationPolicy`` (``flexspec/spec/policy.py``)
chooses each step's mode (plain / decoupled / parallel) once, inside ``LLMEngine.step`` right after scheduling,
and that decision rides in the step's ``ModelInput`` to every TP rank. The controller only reads what happened
(``engine.last_mode``, ``engine.last_step_seconds``, ``engine.spec_metrics``) into its ``EngineSnapshot`` for
``/metrics``. A caller that stops listening (client gone, request cancelled) aborts its requests, which frees
their sequences and KV blocks in the next iteration.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cluster.metrics import STEP_SECONDS_BUCKETS
from configs.sampling import SamplingParams
from flexspec.engine.outputs import RequestOutput
from flexspec.errors import EngineDeadError, EngineStepError, WorkerGroupError

log = logging.getLogger(__name__)


@dataclass
class EngineSnapshot:
    """Engine state read by metrics and health checks (updated by the loop thread, read by anyone).

    Mode fields count executed steps (one forward each) by the mode the engine's policy chose for them;
    ``step_seconds_buckets_by_mode[mode][i]`` counts steps whose time is <= ``STEP_SECONDS_BUCKETS[i]`` and
    above the previous bound (last entry: above every bound). The ``spec_decode_*`` fields are a copy of the
    engine's ``spec_metrics`` (vLLM's counters), ``None`` when the engine has no ``speculative_config``.
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # [0, 1]
    num_preemptions: int = 0
    num_steps_by_mode: dict[str, int] = field(default_factory=dict)
    step_seconds_by_mode: dict[str, float] = field(default_factory=dict)
    step_seconds_buckets_by_mode: dict[str, list[int]] = field(default_factory=dict)
    spec_decode_num_drafts: int | None = None
    spec_decode_num_draft_tokens: int | None = None
    spec_decode_num_accepted_tokens: int | None = None
    spec_decode_num_accepted_tokens_per_pos: list[int] | None = None


@dataclass
class _Stream:
    """Where one caller's outputs go: an asyncio queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: object) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            return False


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


class EngineController:
    """Owns ``engine`` and the thread that steps it.

    Args:
        engine: an ``LLMEngine`` (or anything with its add_request / abort / step / has_unfinished API and
            ``stats.num_steps``, ``last_mode``, ``last_step_seconds``, optionally ``spec_metrics``).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        spec_config = getattr(getattr(engine, "config", None), "speculative_config", None)
        self._speculative = spec_config is not None and hasattr(engine, "spec_metrics")
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.snapshot = EngineSnapshot()
        self._update_snapshot()  # before the loop thread exists: spec counters are exported from the start

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> EngineController:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ---- callers (any asyncio loop) -------------------------------------------------------------------------
    async def generate(
        self, requests: list[tuple[str, list[int], SamplingParams]]
    ) -> AsyncIterator[RequestOutput]:
        """Run ``(request_id, prompt_token_ids, params)`` requests together; yield their outputs as they come.

        Ends when every request finished. Raises the engine's typed error (e.g. ``ContextLengthExceededError``)
        if a request is rejected, ``EngineDeadError`` if the loop died. Leaving early (``aclose``, cancellation)
        aborts the unfinished requests.
        """
        if not self.healthy:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        unfinished = {rid for rid, _, _ in requests}
        for rid, ids, params in requests:
            self._inbox.put(_Add(rid, ids, params, stream))
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in unfinished:
                self._inbox.put(_Abort(rid))

    # ---- loop thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_unfinished)
                if not engine.has_unfinished:
                    continue
                steps_before = engine.stats.num_steps
                outputs = engine.step()  # the engine's policy picks this step's mode inside
                if engine.stats.num_steps != steps_before:  # a forward ran (none when nothing fits the batch)
                    self._record_step(engine.last_mode, engine.last_step_seconds)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    if stream is not None and not stream.put(out):
                        engine.abort(out.request_id)
                self._update_snapshot()
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
            dead = EngineDeadError(f"engine failed: {type(e).__name__}: {e}")
            # The running requests (the failed step's batch) get a 500 that the ingress does not retry elsewhere,
            # since one of them may have caused the failure, unless the device or a rank failed (retryable 503s,
            # like every request still waiting). Only the in-process executor raises the step's own exception:
            # the Ray executor reports any rank's exception as a WorkerGroupError.
            step_failed = EngineStepError(f"engine failed: {type(e).__name__}: {e}")
            in_step = set() if _infrastructure_error(e) else _running_request_ids(engine)
            for request_id, stream in self._streams.items():
                stream.put(step_failed if request_id in in_step else dead)
            self._streams.clear()
            while True:  # fail requests that arrived after the crash too
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, _Add):
                    item.stream.put(dead)

    def _drain(self, block: bool) -> None:
        """Apply queued adds/aborts; when idle, wait for the next one."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.prompt_token_ids, item.params, request_id=item.request_id)
                    self._streams[item.request_id] = item.stream
                except Exception as e:  # noqa: BLE001 - typed errors (400s) go back to the caller
                    item.stream.put(e)
            elif isinstance(item, _Abort):
                self._streams.pop(item.request_id, None)
                self.engine.abort(item.request_id)
            try:
                item = self._inbox.get_nowait()  # None (stop sentinel) falls through both branches
            except queue.Empty:
                break
        self._update_snapshot()

    def _record_step(self, mode: str, seconds: float) -> None:
        """One executed step, in the mode the engine chose for it, taking ``seconds`` (the executor's time)."""
        snap = self.snapshot
        if mode not in snap.num_steps_by_mode:  # new dicts, not new keys: a reader may iterate the old ones
            snap.step_seconds_buckets_by_mode = snap.step_seconds_buckets_by_mode | {
                mode: [0] * (len(STEP_SECONDS_BUCKETS) + 1)
            }
            snap.step_seconds_by_mode = snap.step_seconds_by_mode | {mode: 0.0}
            snap.num_steps_by_mode = snap.num_steps_by_mode | {mode: 0}
        snap.num_steps_by_mode[mode] = snap.num_steps_by_mode.get(mode, 0) + 1
        snap.step_seconds_by_mode[mode] = snap.step_seconds_by_mode.get(mode, 0.0) + seconds
        snap.step_seconds_buckets_by_mode[mode][bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1

    def _update_snapshot(self) -> None:
        s = self.engine.scheduler
        snap = self.snapshot
        snap.num_requests_running = len(s.running)
        snap.num_requests_waiting = len(s.waiting)
        snap.kv_cache_usage = self.engine.block_manager.usage
        snap.num_preemptions = self.engine.stats.num_preemptions
        if self._speculative:
            m = self.engine.spec_metrics
            snap.spec_decode_num_drafts = m.num_drafts
            snap.spec_decode_num_draft_tokens = m.num_draft_tokens
            snap.spec_decode_num_accepted_tokens = m.num_accepted_tokens
            snap.spec_decode_num_accepted_tokens_per_pos = list(m.num_accepted_tokens_per_pos)


def _infrastructure_error(e: BaseException) -> bool:
    """A lost rank, a broken connection or a device fault (out of memory, a faulting kernel): another replica may
    well serve the same requests."""
    import torch

    device_errors = tuple(
        t for t in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if isinstance(t, type)
    )
    return isinstance(e, (WorkerGroupError, EngineDeadError, OSError, EOFError, *device_errors))


def _running_request_ids(engine: Any) -> set[str]:
    """Request ids of the engine's running sequences (a failed step's batch; waiting requests are not in it)."""
    try:
        return {seq.request_id for seq in engine.scheduler.running}
    except Exception:  # noqa: BLE001 - an engine broken enough not to say: treat every request as retryable
        return set()
