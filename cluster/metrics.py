"""Prometheus metrics in vLLM's names (``vllm:*``), served as text at the ingress's ``/metrics``.

Two sources:
* request metrics, measured at the ingress as clients see them (every request passes through it): token
  counters from the exact usage, TTFT / inter-token / end-to-end latency histograms, finished requests;
* engine metrics, read from each replica's ``EngineSnapshot`` (piggybacked on every finished request and
  polled at scrape time), one series per engine (label ``engine`` = Serve replica id, as vLLM labels engines).

Engine metrics include vLLM's speculative-decoding counters (``vllm:spec_decode_num_drafts``, ``..._draft_tokens``,
``..._accepted_tokens``, ``..._accepted_tokens_per_pos{position}``), copied from the engine's own
``SpecDecodingMetrics`` (so MAL = 1 + accepted / drafts, acceptance rate = accepted / draft tokens), and ours:
``flexspec:execution_mode_steps_total{mode}`` (steps by the mode the engine's policy chose) and the
``flexspec:step_seconds{mode}`` histogram (executor time per step).

Adding an engine metric is one row in ``ENGINE_GAUGES`` / ``ENGINE_COUNTERS`` / ``ENGINE_HISTOGRAMS`` naming
the snapshot field; a dict- or list-valued field becomes a labelled family (``mode``, ``position``...); a
``None`` field exports no series. Under Ray's own metrics export the same names get a ``ray_`` prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

# (metric name, snapshot field, help, label for dict/list-valued fields)
ENGINE_GAUGES: list[tuple[str, str, str, str | None]] = [
    ("vllm:num_requests_running", "num_requests_running", "Requests in the engine's running batch.", None),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", None),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 0 to 1 (1 = full).", None),
]
ENGINE_COUNTERS: list[tuple[str, str, str, str | None]] = [
    ("vllm:num_preemptions", "num_preemptions", "Sequences preempted (KV blocks reclaimed).", None),
    # Speculative decoding, vLLM's names and definitions (exported only when speculation is configured).
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts.", None),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens.", None),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        None,
    ),
    (
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        "position",
    ),
    (
        "flexspec:execution_mode_steps",
        "num_steps_by_mode",
        "Engine steps by the execution mode the engine's policy chose.",
        "mode",
    ),
    # Deprecated aliases of flexspec:execution_mode_steps / flexspec:step_seconds_sum (bench/server_bench.py
    # still reads them); drop once nothing does.
    ("flexspec:engine_steps", "num_steps_by_mode", "Deprecated: flexspec:execution_mode_steps.", "mode"),
    (
        "flexspec:engine_step_seconds",
        "step_seconds_by_mode",
        "Deprecated: flexspec:step_seconds_sum.",
        "mode",
    ),
]
# Step times: ~1 ms (GPU decode) to tens of seconds (CPU prefill of long prompts). The controller bins steps.
STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
# (metric name, snapshot field of per-label bucket counts, snapshot field of per-label sums, help, label);
# bucket counts are per bucket of ``STEP_SECONDS_BUCKETS`` plus one past the last bound (not cumulative).
ENGINE_HISTOGRAMS: list[tuple[str, str, str, str, str]] = [
    (
        "flexspec:step_seconds",
        "step_seconds_buckets_by_mode",
        "step_seconds_by_mode",
        "Executor time of one engine step, by the execution mode the engine's policy chose.",
        "mode",
    ),
]

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineStatsCollector:
    """Renders the latest snapshot of every engine replica heard from in the last ``stale_after_s``."""

    def __init__(self, model_name: str, stale_after_s: float = 120.0) -> None:
        self.model_name = model_name
        self.stale_after_s = stale_after_s
        self._snapshots: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def update(self, snapshot: dict[str, Any]) -> None:
        """Record ``snapshot`` (an ``EngineSnapshot`` as a dict plus ``engine``, the replica id)."""
        with self._lock:
            self._snapshots[str(snapshot.get("engine", "0"))] = (time.monotonic(), snapshot)

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        with self._lock:
            live = {k: s for k, (t, s) in self._snapshots.items() if now - t <= self.stale_after_s}
        for table, family in ((ENGINE_GAUGES, GaugeMetricFamily), (ENGINE_COUNTERS, CounterMetricFamily)):
            for name, field, doc, label in table:
                labels = ["model_name", "engine"] + ([label] if label else [])
                metric = family(name, doc, labels=labels)
                for engine, snap in sorted(live.items()):
                    value = snap.get(field)
                    if value is None:
                        continue
                    items = (
                        value.items()
                        if isinstance(value, dict)
                        else enumerate(value)
                        if isinstance(value, list)
                        else None
                    )
                    if items is None:
                        metric.add_metric([self.model_name, engine], float(value))
                    else:
                        for key, v in items:
                            metric.add_metric([self.model_name, engine, str(key)], float(v))
                yield metric
        bounds = [floatToGoString(b) for b in STEP_SECONDS_BUCKETS] + ["+Inf"]
        for name, buckets_field, sum_field, doc, label in ENGINE_HISTOGRAMS:
            hist = HistogramMetricFamily(name, doc, labels=["model_name", "engine", label])
            for engine, snap in sorted(live.items()):
                sums = snap.get(sum_field) or {}
                for key, counts in sorted((snap.get(buckets_field) or {}).items()):
                    cumulative, total = [], 0
                    for le, n in zip(bounds, counts):
                        total += n
                        cumulative.append((le, float(total)))
                    hist.add_metric(
                        [self.model_name, engine, str(key)], cumulative, float(sums.get(key, 0.0))
                    )
            yield hist


class ServerMetrics:
    """All metrics of one ingress replica, in their own registry (``render`` -> Prometheus text)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series, as vLLM's server
        self.model_name = model_name
        self.registry = CollectorRegistry()
        reg, lab = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", lab, registry=reg)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", lab, registry=reg
        )
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", lab + ["finished_reason"], registry=reg
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            lab,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between streamed chunks.",
            lab,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            lab,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.engines = EngineStatsCollector(model_name)
        reg.register(self.engines)  # type: ignore[arg-type]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Times one request from arrival to its last chunk and records it once."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self.t0 = self.last = time.perf_counter()
        self.first: float | None = None
        self.done = False

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        """A chunk with content reached the client."""
        if not any(_has_output(c) for c in chunk.get("choices", ())):
            return
        now = time.perf_counter()
        name = self.m.model_name
        if self.first is None:
            self.first = now
            self.m.ttft.labels(name).observe(now - self.t0)
        else:
            self.m.itl.labels(name).observe(now - self.last)
        self.last = now

    def on_finish(self, usage: dict[str, int], finish_reasons: list[str | None]) -> None:
        if self.done:
            return
        self.done = True
        name = self.m.model_name
        self.m.prompt_tokens.labels(name).inc(usage.get("prompt_tokens", 0))
        self.m.generation_tokens.labels(name).inc(usage.get("completion_tokens", 0))
        self.m.e2e.labels(name).observe(time.perf_counter() - self.t0)
        for r in finish_reasons:
            self.m.request_success.labels(name, r or "abort").inc()

    def on_abort(self, num_unfinished: int) -> None:
        """The client left before the end: its ``num_unfinished`` choices count as ``finished_reason="abort"``."""
        if self.done or num_unfinished <= 0:
            return
        self.done = True
        self.m.request_success.labels(self.m.model_name, "abort").inc(num_unfinished)


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content"))
    return bool(choice.get("text"))
