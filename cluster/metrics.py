"""Prometheus metrics in vLLM's names (``vllm:*``), served as text at the ingress's ``/metrics``.

Two sources:
* request metrics, measured at the ingress as clients see them (every request passes through it): token
  counters from the exact usage, TTFT / inter-token / end-to-end latency histograms, finished requests;
* engine metrics, read from each replica's ``EngineSnapshot`` (piggybacked on every finished request and
  polled at scrape time), one series per engine (label ``engine`` = Serve replica id, as vLLM labels engines).

Adding an engine metric (e.g. the spec-decode counters of the speculative-decoding issue) is one row in
``ENGINE_GAUGES`` / ``ENGINE_COUNTERS`` naming the snapshot field; a dict-valued field becomes a labelled
family (``mode``, ``position``...). Under Ray's own metrics export the same names get a ``ray_`` prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (metric name, snapshot field, help, label for dict/list-valued fields)
ENGINE_GAUGES: list[tuple[str, str, str, str | None]] = [
    ("vllm:num_requests_running", "num_requests_running", "Requests in the engine's running batch.", None),
    ("vllm:num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", None),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 0 to 1 (1 = full).", None),
]
ENGINE_COUNTERS: list[tuple[str, str, str, str | None]] = [
    ("vllm:num_preemptions", "num_preemptions", "Sequences preempted (KV blocks reclaimed).", None),
    ("flexspec:engine_steps", "num_steps_by_mode", "Engine steps by execution mode chosen.", "mode"),
    (
        "flexspec:engine_step_seconds",
        "step_seconds_by_mode",
        "Engine step wall time by execution mode.",
        "mode",
    ),
    # Speculative decoding (vLLM names), once the engine reports them in its snapshot:
    # ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "...", None),
    # ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "...", None),
    # ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "...", None),
    # ("vllm:spec_decode_num_accepted_tokens_per_pos", "spec_decode_num_accepted_tokens_per_pos", "...", "position"),
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


def _has_output(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content"))
    return bool(choice.get("text"))
