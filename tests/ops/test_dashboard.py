"""The Grafana dashboard: committed copies are current, it fits Grafana's dashboard schema, every query names
series the code exports, and ``flexspec dashboard provision`` uploads it through grafana-client."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import pytest
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typer.testing import CliRunner

from cluster.dashboard import (
    CHART_DASHBOARD_PATH,
    DASHBOARD_PATH,
    DASHBOARD_UID,
    DATASOURCE_VAR,
    build_dashboard,
    dashboard_json,
    panel_queries,
)
from flexspec.cli import app
from tests.ops.promql import exported_series, interpolate, unknown_names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return build_dashboard()


def test_committed_copies_are_current(dashboard):
    """`flexspec dashboard export` output is what the repository and the Helm chart hold."""
    text = dashboard_json(dashboard)
    for path in (DASHBOARD_PATH, CHART_DASHBOARD_PATH):
        assert path.read_text() == text, f"{path} is stale: run `flexspec dashboard export`"


def test_export_command_writes_the_dashboard(tmp_path):
    out = tmp_path / "board.json"
    result = CliRunner().invoke(app, ["dashboard", "export", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["uid"] == DASHBOARD_UID


# ---- Grafana's dashboard schema ---------------------------------------------------------------------------------
class GridPos(BaseModel):
    model_config = ConfigDict(extra="forbid")
    h: int = Field(gt=0)
    w: int = Field(gt=0, le=24)
    x: int = Field(ge=0, lt=24)
    y: int = Field(ge=0)

    @model_validator(mode="after")
    def _fits(self) -> GridPos:
        assert self.x + self.w <= 24, "panel runs past the 24-column grid"
        return self


class DataSourceRef(BaseModel):
    type: Literal["prometheus"]
    uid: Literal["${datasource}"]


class Target(BaseModel):
    refId: str = Field(pattern=r"^[A-Z]$")
    expr: str = Field(min_length=1)
    datasource: DataSourceRef


class Panel(BaseModel):
    """What Grafana needs of a panel to place and query it."""

    id: int = Field(gt=0)
    type: Literal["row", "timeseries", "stat"]
    title: str = Field(min_length=1)
    gridPos: GridPos
    datasource: DataSourceRef | None = None
    targets: list[Target] = []

    @model_validator(mode="after")
    def _queries(self) -> Panel:
        if self.type != "row":
            assert self.targets and self.datasource is not None, f"{self.title}: no query"
            assert len({t.refId for t in self.targets}) == len(self.targets), f"{self.title}: refId twice"
        return self


class Variable(BaseModel):
    type: Literal["datasource", "query"]
    name: str = Field(pattern=r"^\w+$")
    query: str


class GrafanaDashboard(BaseModel):
    """The fields of Grafana's dashboard JSON model (schemaVersion >= 39, Grafana 11) that loading relies on."""

    uid: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,40}$")
    title: str = Field(min_length=1)
    schemaVersion: int = Field(ge=39)
    panels: list[Panel] = Field(min_length=1)
    templating: dict[Literal["list"], list[Variable]]

    @model_validator(mode="after")
    def _consistent(self) -> GrafanaDashboard:
        ids = [p.id for p in self.panels]
        assert len(set(ids)) == len(ids), "panel ids must be unique"
        cells = [(p.gridPos.x + i, p.gridPos.y + j) for p in self.panels for i in range(p.gridPos.w)
                 for j in range(p.gridPos.h)]  # fmt: skip
        assert len(set(cells)) == len(cells), "panels overlap"
        variables = {v.name: v for v in self.templating["list"]}
        assert (
            variables[DATASOURCE_VAR].type == "datasource" and variables[DATASOURCE_VAR].query == "prometheus"
        )
        used = {m for p in self.panels for t in p.targets for m in re.findall(r"\$(\w+)", t.expr)}
        assert used - {"__rate_interval"} <= set(variables), f"undefined variables {used - set(variables)}"
        return self


def test_dashboard_fits_grafana_schema(dashboard):
    """Round trip through the Grafana Foundation SDK's dashboard types (generated from Grafana's schema, plugin
    options and Prometheus queries typed): a key Grafana does not define is dropped, so the round trip differs.
    Then the fields Grafana relies on, in a pydantic model."""
    register_default_plugins()
    typed = json.loads(json.dumps(Dashboard.from_json(dashboard), cls=JSONEncoder))
    assert typed == dashboard
    GrafanaDashboard.model_validate(dashboard)


def test_schema_checks_can_fail(dashboard):
    register_default_plugins()
    bad = json.loads(json.dumps(dashboard))
    bad["panels"][5]["options"]["legend"]["showLegnd"] = True  # a timeseries panel
    assert json.loads(json.dumps(Dashboard.from_json(bad), cls=JSONEncoder)) != bad
    bad = json.loads(json.dumps(dashboard))
    bad["panels"][2]["gridPos"] = bad["panels"][1]["gridPos"]
    with pytest.raises(ValueError, match="overlap"):
        GrafanaDashboard.model_validate(bad)


# ---- panels query what the code exports -------------------------------------------------------------------------
def test_every_query_names_exported_series(dashboard):
    series = exported_series()
    queries = panel_queries(dashboard)
    assert len(queries) >= 20
    problems = {f"{title}: {expr}": unknown_names(interpolate(expr), series) for title, expr in queries}
    assert {k: v for k, v in problems.items() if v} == {}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]).groups()
            assert unknown_names(interpolate(selector), series) == []
            assert label in series[selector.split("{")[0]]


def test_charted_metrics_cover_the_issue(dashboard):
    """Issue 8's panels: acceptance rate, MAL, per-position acceptance, token rates, modes, step time, latency
    percentiles, throughput, KV usage, replicas."""
    exprs = " ".join(expr for _, expr in panel_queries(dashboard))
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "flexspec:execution_mode_steps_total",
        "flexspec:step_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
    ):
        assert name in exprs, name
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Acceptance rate", "Mean acceptance length (MAL)", "Per-position acceptance rate", "Mode decisions",
            "Step time by mode", "Time to first token", "Inter-token latency", "KV-cache usage",
            "Engine replicas"} <= titles  # fmt: skip


def test_cross_check_catches_wrong_names():
    series = exported_series()
    assert unknown_names('rate(vllm:spec_decode_num_draft_total{model_name=~".*"}[1m])', series) == [
        "metric vllm:spec_decode_num_draft_total is not exported"
    ]
    assert unknown_names('sum by (replica) (vllm:kv_cache_usage_perc{engine=~".*"})', series) == [
        "no metric of the expression has label replica"
    ]


# ---- provisioning -------------------------------------------------------------------------------------------------
class _GrafanaAPI(BaseHTTPRequestHandler):
    """The four Grafana HTTP API routes provisioning uses, with Grafana's status codes (no Grafana server can be
    installed here): datasources by uid, folders, dashboards/db. State lives on the server object."""

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        state = self.server.state  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        state["calls"].append((method, self.path, self.headers.get("Authorization"), body))
        if self.headers.get("Authorization") != "Bearer secret":
            return self._reply(401, {"message": "Unauthorized"})
        if m := re.fullmatch(r"/api/datasources/uid/([\w-]+)", self.path):
            uid = m.group(1)
            if method == "GET":
                found = state["datasources"].get(uid)
                return self._reply(200, found) if found else self._reply(404, {"message": "not found"})
            state["datasources"][uid] = body
            return self._reply(200, {"message": "Datasource updated"})
        if self.path == "/api/datasources" and method == "POST":
            state["datasources"][body["uid"]] = body
            return self._reply(200, {"message": "Datasource added", "id": 1})
        if m := re.fullmatch(r"/api/folders/([\w-]+)", self.path):
            found = state["folders"].get(m.group(1))
            return self._reply(200, found) if found else self._reply(404, {"message": "folder not found"})
        if self.path == "/api/folders" and method == "POST":
            state["folders"][body["uid"]] = body
            return self._reply(200, body)
        if self.path == "/api/dashboards/db" and method == "POST":
            uid = body["dashboard"]["uid"]
            version = state["dashboards"].get(uid, {}).get("version", 0) + 1
            state["dashboards"][uid] = {"body": body, "version": version}
            return self._reply(200, {"uid": uid, "version": version, "url": f"/d/{uid}", "status": "success"})
        return self._reply(404, {"message": "no such route"})

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def grafana_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GrafanaAPI)
    server.state = {"calls": [], "datasources": {}, "folders": {}, "dashboards": {}}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_provision_uploads_datasource_and_dashboard(grafana_api, dashboard):
    url = f"http://127.0.0.1:{grafana_api.server_address[1]}"
    args = ["dashboard", "provision", "--grafana-url", url, "--prometheus-url", "http://prom:9090"]
    for _ in range(2):  # idempotent: the second run updates in place
        result = CliRunner().invoke(app, args, env={"GRAFANA_API_KEY": "secret"})
        assert result.exit_code == 0, result.output
    state = grafana_api.state
    assert state["datasources"]["flexspec-prometheus"]["url"] == "http://prom:9090"
    assert state["datasources"]["flexspec-prometheus"]["type"] == "prometheus"
    assert [c[:2] for c in state["calls"] if c[0] != "GET"] == [
        ("POST", "/api/datasources"), ("POST", "/api/folders"), ("POST", "/api/dashboards/db"),
        ("PUT", "/api/datasources/uid/flexspec-prometheus"), ("POST", "/api/dashboards/db"),
    ]  # fmt: skip
    uploaded = state["dashboards"][DASHBOARD_UID]
    assert uploaded["version"] == 2 and "version 2" in result.output
    body = uploaded["body"]
    assert body["overwrite"] is True and body["folderUid"] == "flexspec"
    current = {v["name"]: v.get("current") for v in body["dashboard"]["templating"]["list"]}
    assert current[DATASOURCE_VAR] == {"text": "flexspec-prometheus", "value": "flexspec-prometheus"}
    body["dashboard"]["templating"] = dashboard["templating"]
    assert body["dashboard"] == dashboard


def test_provision_reports_refusal(grafana_api):
    url = f"http://127.0.0.1:{grafana_api.server_address[1]}"
    result = CliRunner().invoke(app, ["dashboard", "provision", "--grafana-url", url, "--api-key", "wrong"])
    assert result.exit_code == 2
    assert "Grafana refused the upload" in result.output
    result = CliRunner().invoke(
        app, ["dashboard", "provision", "--grafana-url", url, "--basic-auth", "nopass"]
    )
    assert result.exit_code == 2 and "USER:PASSWORD" in result.output
