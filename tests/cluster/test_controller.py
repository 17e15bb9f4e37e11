"""EngineController without Ray: streaming, cancellation frees KV, errors, the engine's mode recorded once per
step, and the spec-decode counters at /metrics equal the engine's own."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from cluster.controller import EngineController
from cluster.errors import EngineDeadError
from cluster.metrics import STEP_SECONDS_BUCKETS, ServerMetrics
from cluster.server import LLMServer
from configs import EngineConfig, SamplingParams
from flexspec.errors import ContextLengthExceededError, EngineStepError, WorkerGroupError
from tests.conftest import DEFAULT_MODEL

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture
def controller(engine):
    ctl = EngineController(engine).start()
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


def test_plain_engine_steps_are_recorded_as_plain(controller, engine):
    async def run() -> None:
        async for _ in controller.generate(
            [("p", engine.encode("Hello"), SamplingParams(max_tokens=5, temperature=0.0))]
        ):
            pass

    steps_before = engine.stats.num_steps
    plain_before = controller.snapshot.num_steps_by_mode.get("plain", 0)
    asyncio.run(run())
    steps = engine.stats.num_steps - steps_before
    assert steps >= 5
    assert set(controller.snapshot.num_steps_by_mode) == {"plain"}
    assert controller.snapshot.num_steps_by_mode["plain"] - plain_before == steps
    assert controller.snapshot.spec_decode_num_drafts is None  # no speculation: no spec-decode series


@pytest.fixture(scope="module")
def ngram_engine():
    """A real engine with ngram speculation; its SpeculationPolicy (execution auto) picks each step's mode."""
    from flexspec.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cpu", speculative_config=NGRAM)
    )


def _chat_ids(engine, questions: list[str]) -> list[list[int]]:
    return [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def test_controller_records_one_engine_mode_per_step(ngram_engine, engine, monkeypatch):
    """The controller decides nothing: every executed step is recorded once, in the mode the engine's policy
    chose for it (``engine.last_mode``) with the engine's step time (``engine.last_step_seconds``)."""
    prompts = _chat_ids(engine, ["Repeat after me: the cat sat on the mat, the cat sat on the mat.", "Hi!"])
    params = SamplingParams(max_tokens=24, temperature=0.0)
    refs = engine.generate(prompts, params)  # plain decoding, TP=1

    eng = ngram_engine
    seen: list[tuple[str, float]] = []
    step = eng.step

    def spying_step():
        before = eng.stats.num_steps
        out = step()
        if eng.stats.num_steps != before:
            seen.append((eng.last_mode, eng.last_step_seconds))
        return out

    monkeypatch.setattr(eng, "step", spying_step)
    counts_before = Counter(eng.policy.mode_counts)
    steps_before = eng.stats.num_steps

    ctl = EngineController(eng).start()
    try:

        async def run() -> dict[str, list[int]]:
            got: dict[str, list[int]] = {}
            async for out in ctl.generate([("a", prompts[0], params), ("b", prompts[1], params)]):
                got[out.request_id] = out.token_ids
            return got

        got = asyncio.run(run())
    finally:
        ctl.stop()
    assert [got["a"], got["b"]] == [r.token_ids for r in refs]  # speculation stays exact at T=0

    snap = ctl.snapshot
    steps = eng.stats.num_steps - steps_before
    modes = Counter(m for m, _ in seen)
    assert len(seen) == steps > 0
    assert snap.num_steps_by_mode == dict(modes)  # one mode per step, the engine's
    assert modes == Counter(eng.policy.mode_counts) - counts_before  # = the policy's decisions
    assert "decoupled" in modes  # the policy's warm-up tries speculation
    for mode, n in modes.items():
        assert snap.step_seconds_by_mode[mode] == pytest.approx(sum(t for m, t in seen if m == mode))
        buckets = snap.step_seconds_buckets_by_mode[mode]
        assert len(buckets) == len(STEP_SECONDS_BUCKETS) + 1 and sum(buckets) == n


def _scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus text -> {sample name: {sorted labels: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_metrics_spec_decode_counters_equal_engine(ngram_engine):
    """Real requests through the replica class (controller + OpenAI formatting), snapshots fed to the ingress's
    collector exactly as the ingress does: the scraped vllm:spec_decode_* values equal ``engine.spec_metrics``."""
    engine = ngram_engine
    args = {
        "model": DEFAULT_MODEL,
        "served_model_name": "m",
        "speculative_config": NGRAM,
        "engine": {"device": "cpu", "max_model_len": 1024},
    }
    server = LLMServer(args, engine_factory=lambda _: engine)
    metrics = ServerMetrics("m")
    bodies = [
        {
            "model": "m",
            "prompt": "def fib(n):\n    if n < 2:\n        return n\n    return",
            "max_tokens": 32,
        },
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Count: one, two, three, four"}],
            "max_tokens": 24,
        },
    ]
    counts_before = Counter(engine.policy.mode_counts)
    steps_before = engine.stats.num_steps

    async def run() -> None:
        for body in bodies:
            method = server.chat if "messages" in body else server.completion
            async for chunk in method(body | {"temperature": 0}):
                assert "error" not in chunk, chunk
                if "_engine" in chunk:
                    metrics.engines.update(chunk.pop("_engine"))  # what the ingress does with the usage chunk

    try:
        asyncio.run(run())
    finally:
        server.controller.stop()
    metrics.engines.update(server.stats())  # what a scrape does: refresh from the (now idle) replica
    got = _scrape(metrics.render().decode())
    m = engine.spec_metrics
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0
    base = (("engine", "local"), ("model_name", "m"))

    assert got["vllm:spec_decode_num_drafts_total"] == {base: m.num_drafts}
    assert got["vllm:spec_decode_num_draft_tokens_total"] == {base: m.num_draft_tokens}
    assert got["vllm:spec_decode_num_accepted_tokens_total"] == {base: m.num_accepted_tokens}
    per_pos = got["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos == {
        tuple(sorted(base + (("position", str(i)),))): n for i, n in enumerate(m.num_accepted_tokens_per_pos)
    }
    # Steps by mode count this replica's steps: the engine's decisions since the replica started.
    decisions = Counter(engine.policy.mode_counts) - counts_before
    modes = got["flexspec:execution_mode_steps_total"]
    assert sum(modes.values()) == engine.stats.num_steps - steps_before == decisions.total()
    for labels, n in modes.items():
        mode = dict(labels)["mode"]
        assert n == decisions[mode]
        assert got["flexspec:step_seconds_count"][labels] == n
        assert got["flexspec:step_seconds_bucket"][tuple(sorted(labels + (("le", "+Inf"),)))] == n


class _FailingEngine:
    """Just enough engine for the controller; ``step`` fails like a dead TP rank (``error``: as something
    else)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error or WorkerGroupError("TP worker group failed during execute: rank 1 died")
        self.config = SimpleNamespace(speculative_config=None)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.block_manager = SimpleNamespace(usage=0.0)
        self.stats = SimpleNamespace(num_preemptions=0, num_steps=0)
        self.pending: set[str] = set()

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add_request(self, ids, params, request_id):
        self.pending.add(request_id)
        if not request_id.startswith("waiting"):  # admitted to the batch; "waiting-*" ones queue behind it
            self.scheduler.running.append(SimpleNamespace(request_id=request_id))

    def abort(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def step(self) -> list:
        raise self.error


def test_engine_failure_fails_requests_and_health():
    ctl = EngineController(_FailingEngine()).start()

    async def run() -> None:
        async for _ in ctl.generate([("r", [1, 2], SamplingParams())]):
            pass

    try:
        with pytest.raises(
            EngineDeadError, match="rank 1 died"
        ):  # 503 engine_unavailable: the ingress retries
            asyncio.run(run())
        assert not ctl.healthy
        with pytest.raises(EngineDeadError):  # later requests fail fast too
            asyncio.run(run())
    finally:
        ctl.stop()


@pytest.mark.parametrize(
    ("error", "batch_gets"),
    [
        (ValueError("Overflow when unpacking long long"), EngineStepError),  # what a huge top_k once raised
        (torch.OutOfMemoryError("CUDA out of memory"), EngineDeadError),  # the device, not the requests
    ],
)
def test_a_step_that_fails_in_the_engine_is_not_retried_elsewhere(error, batch_gets):
    """A step that raises for another reason than a lost rank or a device fault fails its batch's requests with
    a 500 the ingress does not retry on the next replica, since one of them may be the cause; requests waiting
    behind the batch, and those that arrive afterwards, get the retryable 503."""
    ctl = EngineController(_FailingEngine(error)).start()

    async def run(request_id: str) -> None:
        async for _ in ctl.generate([(request_id, [1, 2], SamplingParams())]):
            pass

    async def both() -> list:
        return await asyncio.gather(run("r"), run("waiting-1"), return_exceptions=True)

    try:
        in_batch, waiting = asyncio.run(both())
        assert type(in_batch) is batch_gets and type(waiting) is EngineDeadError, (in_batch, waiting)
        if batch_gets is EngineStepError:
            assert (in_batch.status, in_batch.type) == (
                500,
                "server_error",
            ) and "Overflow" in in_batch.message
        assert not ctl.healthy
        with pytest.raises(EngineDeadError):
            asyncio.run(run("r2"))
    finally:
        ctl.stop()
