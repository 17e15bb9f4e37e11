"""PromQL of dashboard panels, checked against the series the code exports (names and labels).

Grafana interpolates template variables before a query reaches Prometheus; ``interpolate`` does the same with
fixed values so the expressions parse (``promql-parser``) or run on a real Prometheus.
"""

from __future__ import annotations

import dataclasses

import promql_parser

from cluster.controller import EngineSnapshot
from cluster.metrics import STEP_SECONDS_BUCKETS, ServerMetrics


def interpolate(expr: str, model_name: str = ".*", engine: str = ".*", rate_interval: str = "1m") -> str:
    """``expr`` with Grafana's variables replaced (``$__rate_interval`` first: ``$model_name`` is no prefix)."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$model_name", model_name)
        .replace("$engine", engine)
    )


def exported_series() -> dict[str, set[str]]:
    """Sample name -> label names of every series a ``ServerMetrics`` registry serves once it has seen one finished
    request and one engine snapshot with speculation and step times (the ingress's ``/metrics``)."""
    metrics = ServerMetrics("model")
    snapshot = EngineSnapshot(
        num_steps_by_mode={"parallel": 3},
        step_seconds_by_mode={"parallel": 0.03},
        step_seconds_buckets_by_mode={"parallel": [3] + [0] * len(STEP_SECONDS_BUCKETS)},
        spec_decode_num_drafts=3,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=5,
        spec_decode_num_accepted_tokens_per_pos=[3, 2, 0, 0],
    )
    metrics.engines.update({"engine": "replica-1", **dataclasses.asdict(snapshot)})
    tracker = metrics.tracker()
    for text in ("Hel", "lo"):
        tracker.on_chunk({"choices": [{"delta": {"content": text}}]})
    tracker.on_finish({"prompt_tokens": 4, "completion_tokens": 2}, ["stop"])
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def unknown_names(expr: str, series: dict[str, set[str]]) -> list[str]:
    """Problems of one (interpolated) expression: metrics not in ``series``, label matchers or aggregation /
    matching labels that none of the expression's metrics carry. Empty when the expression is consistent.

    Raises:
        ValueError: ``expr`` is not valid PromQL.
    """
    selectors: list[promql_parser.VectorSelector] = []
    grouping: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            selectors.append(node)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier and node.modifier.matching:
            grouping.update(node.modifier.matching.labels)

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    problems = []
    labels_in_expr: set[str] = set()
    for sel in selectors:
        if sel.name not in series:
            problems.append(f"metric {sel.name} is not exported")
            continue
        labels_in_expr |= series[sel.name]
        problems += [
            f"{sel.name} has no label {m.name}"
            for m in sel.matchers.matchers
            if m.name not in series[sel.name]
        ]
    problems += [
        f"no metric of the expression has label {label}" for label in sorted(grouping - labels_in_expr)
    ]
    return problems
