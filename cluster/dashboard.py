"""The Grafana dashboard of a flexspec deployment, generated from the metric definitions in ``cluster.metrics``.

Panels name metrics through ``cluster.metrics`` (the ingress's ``ServerMetrics`` and the ``ENGINE_*`` tables), never
as retyped strings, so a renamed metric changes the dashboard with it. The names are the ones the ingress serves on
``/metrics`` (prometheus-client exposition: counters end in ``_total``, histograms in ``_bucket/_sum/_count``; no
``ray_`` prefix, since these metrics do not go through Ray's metrics agent).

Definitions (vLLM's, issue 8; DESIGN.md section 4):
* acceptance rate = accepted tokens / draft tokens;
* MAL (mean acceptance length) = 1 + accepted tokens / drafts (tokens emitted per verification step);
* per-position acceptance rate = accepted tokens at draft position i / drafts;
* verification length = draft tokens / drafts (tokens the target verified per draft; below
  ``num_speculative_tokens`` when selective verification or ``disable_by_batch_size`` trims drafts).

Engine metrics come from engine snapshots that every ingress replica re-exports, so the same engine series can be
scraped once per ingress: engine queries take ``max by (engine)`` before summing across replicas. Request metrics
(TTFT, ITL, tokens) are counted once per request by the ingress that served it and are summed.

``flexspec dashboard export`` writes the JSON to ``ops/grafana/`` and the Helm chart's copy; ``flexspec dashboard
provision`` uploads it with a Prometheus datasource (``cluster/dashboard_provision.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh

from cluster.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, ENGINE_HISTOGRAMS, ServerMetrics

REPO_ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = REPO_ROOT / "ops" / "grafana" / "flexspec-dashboard.json"
CHART_DASHBOARD_PATH = REPO_ROOT / "helm" / "flexspec" / "dashboards" / "flexspec-dashboard.json"
DASHBOARD_UID = "flexspec-overview"
DATASOURCE_VAR = "datasource"
RATE = "$__rate_interval"  # Grafana's rate window: at least 4 scrape intervals
QUANTILES = (0.5, 0.9, 0.99)
_DS = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")


@dataclass(frozen=True)
class MetricNames:
    """Metric family names as ``cluster.metrics`` defines them (counters without their ``_total`` suffix)."""

    prompt_tokens: str
    generation_tokens: str
    request_success: str
    ttft: str
    itl: str
    e2e: str
    running: str
    waiting: str
    kv_usage: str
    preemptions: str
    drafts: str
    draft_tokens: str
    accepted_tokens: str
    accepted_per_pos: str
    mode_steps: str
    step_seconds: str

    @classmethod
    def from_code(cls) -> MetricNames:
        """Read the names from a ``ServerMetrics`` instance and the engine tables (by snapshot field).

        Raises:
            LookupError: a snapshot field the dashboard charts has no metric row any more.
        """
        m = ServerMetrics("")

        def family(metric: Any) -> str:
            return metric.describe()[0].name

        def engine(field: str) -> str:
            for name, f, doc, _ in ENGINE_GAUGES + ENGINE_COUNTERS:
                if f == field and not doc.startswith("Deprecated"):
                    return name
            for name, buckets_field, *_ in ENGINE_HISTOGRAMS:
                if buckets_field == field:
                    return name
            raise LookupError(f"cluster.metrics exports no metric for snapshot field {field!r}")

        return cls(
            prompt_tokens=family(m.prompt_tokens),
            generation_tokens=family(m.generation_tokens),
            request_success=family(m.request_success),
            ttft=family(m.ttft),
            itl=family(m.itl),
            e2e=family(m.e2e),
            running=engine("num_requests_running"),
            waiting=engine("num_requests_waiting"),
            kv_usage=engine("kv_cache_usage"),
            preemptions=engine("num_preemptions"),
            drafts=engine("spec_decode_num_drafts"),
            draft_tokens=engine("spec_decode_num_draft_tokens"),
            accepted_tokens=engine("spec_decode_num_accepted_tokens"),
            accepted_per_pos=engine("spec_decode_num_accepted_tokens_per_pos"),
            mode_steps=engine("num_steps_by_mode"),
            step_seconds=engine("step_seconds_buckets_by_mode"),
        )


# ---- PromQL ---------------------------------------------------------------------------------------------------
def _req(series: str) -> str:
    """A request-metric series of the selected model."""
    return f'{series}{{model_name=~"$model_name"}}'


def _eng(series: str) -> str:
    """An engine-metric series of the selected model and engine replicas."""
    return f'{series}{{model_name=~"$model_name", engine=~"$engine"}}'


def _engine_rate(counter: str, by: str = "") -> str:
    """Per-engine rate of an engine counter, deduplicated across ingress replicas: ``max by (engine, by)``."""
    labels = ", ".join(["engine"] + ([by] if by else []))
    return f"max by ({labels}) (rate({_eng(counter + '_total')}[{RATE}]))"


def _engine_hist_rate(hist: str, suffix: str, by: str) -> str:
    return f"max by (engine, {by}) (rate({_eng(hist + suffix)}[{RATE}]))"


def _quantile(q: float, hist: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({_req(hist + '_bucket')}[{RATE}])))"


# ---- panels -----------------------------------------------------------------------------------------------------
def _query(expr: str, legend: str, ref_id: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).datasource(_DS).range()


def _targets(queries: list[tuple[str, str]]) -> list[prometheus.Dataquery]:
    return [_query(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def _timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    stacking: common.StackingMode = common.StackingMode.NONE,
    width: int = 12,
) -> timeseries.Panel:
    legend = (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
    )
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(_DS)
        .unit(unit)
        .targets(_targets(queries))
        .legend(legend)
        .span(width)
        .height(8)
        .fill_opacity(10 if stacking == common.StackingMode.NONE else 60)
    )
    if stacking != common.StackingMode.NONE:
        panel = panel.stacking(common_builders.StackingConfig().mode(stacking))
    return panel


def _stat(title: str, description: str, unit: str, expr: str, decimals: int = 2) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(_DS)
        .unit(unit)
        .decimals(decimals)
        .targets(_targets([(expr, title)]))
        .graph_mode(common.BigValueGraphMode.AREA)
        .span(6)
        .height(4)
    )


def _spec_panels(n: MetricNames) -> list[Any]:
    acc, draft_tok, drafts = (
        _engine_rate(n.accepted_tokens),
        _engine_rate(n.draft_tokens),
        _engine_rate(n.drafts),
    )
    per_pos = (
        f"sum by (position) ({_engine_rate(n.accepted_per_pos, 'position')})"
        f" / ignoring(position) group_left sum({drafts})"
    )
    return [
        _stat(
            "Acceptance rate",
            "Accepted / draft tokens, all replicas.",
            "percentunit",
            f"sum({acc}) / sum({draft_tok})",
        ),
        _stat(
            "Mean acceptance length",
            "1 + accepted tokens / drafts: tokens per verification step.",
            "none",
            f"1 + sum({acc}) / sum({drafts})",
        ),
        _stat(
            "Verification length",
            "Draft tokens verified per draft.",
            "none",
            f"sum({draft_tok}) / sum({drafts})",
        ),
        _stat(
            "Engine replicas",
            "Engine replicas reporting metrics (one per LLMServer replica).",
            "none",
            f"count(max by (engine) ({_eng(n.running)}))",
            decimals=0,
        ),
        _timeseries(
            "Acceptance rate",
            "Accepted / draft tokens, per engine replica.",
            "percentunit",
            [(f"{acc} / {draft_tok}", "{{engine}}"), (f"sum({acc}) / sum({draft_tok})", "all")],
        ),
        _timeseries(
            "Mean acceptance length (MAL)",
            "1 + accepted tokens / drafts, per engine replica.",
            "none",
            [(f"1 + {acc} / {drafts}", "{{engine}}"), (f"1 + sum({acc}) / sum({drafts})", "all")],
        ),
        _timeseries(
            "Per-position acceptance rate",
            "Drafts whose token at position i (0-based) was accepted / drafts.",
            "percentunit",
            [(per_pos, "position {{position}}")],
        ),
        _timeseries(
            "Accepted / draft tokens per second",
            "Speculative-decoding token rates, all replicas.",
            "short",
            [(f"sum({acc})", "accepted"), (f"sum({draft_tok})", "drafted")],
        ),
        _timeseries(
            "Verification length",
            "Draft tokens the target verified per draft, per engine replica.",
            "none",
            [(f"{draft_tok} / {drafts}", "{{engine}}")],
            width=24,
        ),
    ]


def _mode_panels(n: MetricNames) -> list[Any]:
    steps = f"sum by (mode) ({_engine_rate(n.mode_steps, 'mode')})"
    hist = n.step_seconds
    buckets = f"sum by (mode, le) ({_engine_hist_rate(hist, '_bucket', 'mode, le')})"
    mean = (
        f"sum by (mode) ({_engine_hist_rate(hist, '_sum', 'mode')})"
        f" / sum by (mode) ({_engine_hist_rate(hist, '_count', 'mode')})"
    )
    return [
        _timeseries(
            "Mode decisions",
            "Share of engine steps by the execution mode the policy chose (plain / decoupled / parallel).",
            "percentunit",
            [(steps, "{{mode}}")],
            stacking=common.StackingMode.PERCENT,
            width=8,
        ),
        _timeseries(
            "Steps per second by mode",
            "Engine steps (one batched forward each) per second.",
            "short",
            [(steps, "{{mode}}")],
            stacking=common.StackingMode.NORMAL,
            width=8,
        ),
        _timeseries(
            "Step time by mode",
            "Executor time per step: p50 / p95 from the histogram, and the mean.",
            "s",
            [
                (f"histogram_quantile(0.5, {buckets})", "{{mode}} p50"),
                (f"histogram_quantile(0.95, {buckets})", "{{mode}} p95"),
                (mean, "{{mode}} mean"),
            ],
            width=8,
        ),
    ]


def _latency_panels(n: MetricNames) -> list[Any]:
    def percentiles(hist: str) -> list[tuple[str, str]]:
        return [(_quantile(q, hist), f"p{round(q * 100)}") for q in QUANTILES]

    return [
        _timeseries(
            "Time to first token",
            "Request arrival to first content chunk, at the ingress.",
            "s",
            percentiles(n.ttft),
            width=8,
        ),
        _timeseries(
            "Inter-token latency",
            "Time between streamed content chunks (a chunk may carry several tokens under speculation).",
            "s",
            percentiles(n.itl),
            width=8,
        ),
        _timeseries(
            "End-to-end request latency",
            "Request arrival to its last chunk.",
            "s",
            percentiles(n.e2e),
            width=8,
        ),
    ]


def _load_panels(n: MetricNames) -> list[Any]:
    def req_rate(counter: str, by: str = "") -> str:
        return f"sum{f' by ({by})' if by else ''} (rate({_req(counter + '_total')}[{RATE}]))"

    return [
        _timeseries(
            "Token throughput",
            "Tokens per second, counted from each request's exact usage.",
            "short",
            [(req_rate(n.generation_tokens), "generated"), (req_rate(n.prompt_tokens), "prompt")],
        ),
        _timeseries(
            "Finished requests",
            "Requests per second by finish reason.",
            "reqps",
            [(req_rate(n.request_success, "finished_reason"), "{{finished_reason}}")],
        ),
        _timeseries(
            "Running / waiting requests",
            "Requests in each engine's batch and queue.",
            "short",
            [
                (f"max by (engine) ({_eng(n.running)})", "running {{engine}}"),
                (f"max by (engine) ({_eng(n.waiting)})", "waiting {{engine}}"),
            ],
        ),
        _timeseries(
            "KV-cache usage",
            "Fraction of each engine's KV blocks in use.",
            "percentunit",
            [(f"max by (engine) ({_eng(n.kv_usage)})", "{{engine}}")],
        ),
        _timeseries(
            "Engine replicas",
            "LLMServer replicas reporting (Serve autoscaling from ongoing requests).",
            "none",
            [(f"count(max by (engine) ({_eng(n.running)}))", "replicas")],
        ),
        _timeseries(
            "Preemptions",
            "Sequences preempted per second (KV blocks reclaimed).",
            "short",
            [(f"sum({_engine_rate(n.preemptions)})", "preemptions")],
        ),
    ]


def build_dashboard(names: MetricNames | None = None) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a dict), from the metric names the code exports."""
    n = names or MetricNames.from_code()
    ds_var = dash.DatasourceVariable(DATASOURCE_VAR).label("Data source").type("prometheus")
    model_var = (
        dash.QueryVariable("model_name")
        .label("Model")
        .datasource(_DS)
        .query(f"label_values({n.generation_tokens}_total, model_name)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
    )
    engine_var = (
        dash.QueryVariable("engine")
        .label("Engine replica")
        .datasource(_DS)
        .query(f'label_values({n.running}{{model_name=~"$model_name"}}, engine)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )
    board = (
        dash.Dashboard("flexspec: LLM serving with speculative decoding")
        .uid(DASHBOARD_UID)
        .description("Speculative decoding, execution modes, latency and load of flexspec Serve apps.")
        .tags(["flexspec", "vllm", "speculative-decoding", "ray-serve"])
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(ds_var)
        .with_variable(model_var)
        .with_variable(engine_var)
    )
    rows = [
        ("Speculative decoding", _spec_panels(n)),
        ("Execution modes", _mode_panels(n)),
        ("Latency", _latency_panels(n)),
        ("Throughput and load", _load_panels(n)),
    ]
    panel_id = 0
    for title, panels in rows:
        panel_id += 1
        board = board.with_row(dash.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def dashboard_json(dashboard: dict[str, Any] | None = None) -> str:
    """Stable text of the dashboard JSON (what the repository and the Helm chart hold)."""
    return json.dumps(dashboard or build_dashboard(), indent=2) + "\n"


def export(paths: tuple[Path, ...] = (DASHBOARD_PATH, CHART_DASHBOARD_PATH)) -> list[Path]:
    """Write the dashboard JSON to ``paths`` (default: ``ops/grafana/`` and the Helm chart's copy)."""
    text = dashboard_json()
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(paths)


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, PromQL expression)`` of every panel target in ``dashboard``."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard.get("panels", [])
        for target in panel.get("targets", [])
    ]
