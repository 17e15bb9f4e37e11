"""EngineController without Ray: streaming, cancellation frees KV, errors, one policy decision per step."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from cluster.controller import EngineController
from cluster.errors import EngineDeadError
from cluster.policy import BatchView, DefaultExecutionPolicy, ExecutionDecision
from configs import SamplingParams
from configs.speculative import parse_speculative_config
from flexspec.errors import ContextLengthExceededError


class CountingPolicy:
    def __init__(self) -> None:
        self.calls: list[BatchView] = []

    def choose(self, batch: BatchView) -> ExecutionDecision:
        self.calls.append(batch)
        return ExecutionDecision("plain")


@pytest.fixture
def controller(engine):
    policy = CountingPolicy()
    ctl = EngineController(engine, policy).start()
    ctl.test_policy = policy  # type: ignore[attr-defined]
    yield ctl
    ctl.stop()
    assert not engine.has_unfinished  # leave the shared engine clean


def _wait(pred, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_streams_equal_offline_generate(engine):
    prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in ("Hi!", "What is 2+2?")]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    refs = engine.generate(prompts, params)
    ctl = EngineController(engine).start()
    try:

        async def run() -> dict[str, list]:
            got: dict[str, list] = {"a": [], "b": []}
            async for out in ctl.generate([("a", prompts[0], params), ("b", prompts[1], params)]):
                got[out.request_id].append(out)
            return got

        got = asyncio.run(run())
    finally:
        ctl.stop()
    for rid, ref in zip("ab", refs):
        outs = got[rid]
        assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
        assert "".join(o.new_text for o in outs) == ref.text
        assert sum(len(o.new_token_ids) for o in outs) == len(ref.token_ids)


def test_leaving_early_aborts_and_frees_kv(controller, engine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def run() -> int:
        n = 0
        gen = controller.generate([("long", engine.encode("Count to a thousand:"), params)])
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()
        return n

    assert asyncio.run(run()) == 3
    _wait(lambda: not engine.has_unfinished and engine.block_manager.usage == 0.0)
    assert controller.snapshot.num_requests_running == 0


def test_rejected_request_raises_typed_error(controller, engine):
    too_long = [1] * engine.config.max_model_len

    async def run() -> None:
        async for _ in controller.generate([("x", too_long, SamplingParams())]):
            pass

    with pytest.raises(ContextLengthExceededError):
        asyncio.run(run())
    assert controller.healthy


def test_policy_decides_once_per_step(controller, engine):
    async def run() -> None:
        async for _ in controller.generate(
            [("p", engine.encode("Hello"), SamplingParams(max_tokens=5, temperature=0.0))]
        ):
            pass

    steps_before = engine.stats.num_steps
    asyncio.run(run())
    steps = engine.stats.num_steps - steps_before
    assert steps >= 5
    assert len(controller.test_policy.calls) == steps
    assert controller.snapshot.num_steps_by_mode["plain"] == steps


def test_default_policy_modes():
    ngram = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    )
    view = BatchView(num_running=4, num_waiting=0, kv_cache_usage=0.1)
    assert DefaultExecutionPolicy(None).choose(view) == ExecutionDecision("plain")
    assert DefaultExecutionPolicy(ngram).choose(view) == ExecutionDecision("decoupled", 3)
    assert DefaultExecutionPolicy(ngram).choose(BatchView(9, 0, 0.1)).mode == "plain"
    forced = ngram.model_copy(update={"execution": "parallel"})
    assert DefaultExecutionPolicy(forced).choose(view).mode == "parallel"


class _FailingEngine:
    """Just enough engine for the controller; ``step`` fails like a dead TP rank."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(speculative_config=None)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.block_manager = SimpleNamespace(usage=0.0)
        self.stats = SimpleNamespace(num_preemptions=0)
        self.pending: set[str] = set()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add_request(self, ids, params, request_id):
        self.pending.add(request_id)

    def abort(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def step(self) -> list:
        raise RuntimeError("TP worker group failed during execute: rank 1 died")


def test_engine_failure_fails_requests_and_health():
    ctl = EngineController(_FailingEngine()).start()

    async def run() -> None:
        async for _ in ctl.generate([("r", [1, 2], SamplingParams())]):
            pass

    try:
        with pytest.raises(EngineDeadError, match="rank 1 died"):
            asyncio.run(run())
        assert not ctl.healthy
        with pytest.raises(EngineDeadError):  # later requests fail fast too
            asyncio.run(run())
    finally:
        ctl.stop()
