"""The Helm chart helm/flexspec, rendered by Helm's own engine (helm-python-sdk bundles Helm v4's Go SDK):
lint, KubeRay CRD schemas for the RayService and its RayCluster, Kubernetes schemas for plain objects
(kubernetes-validate), serveConfigV2 through the project's Serve config loader, GPU vendors, autoscaling."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.chart_values import SCHEMA_PATH, ChartValues, schema_json
from cluster.dashboard import DASHBOARD_PATH
from cluster.launcher import load_serve_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "flexspec"
CRDS = REPO / "tests" / "data" / "kuberay-crds"
# values file -> the Serve config preset its serveConfig must equal
PRESETS = {
    "values.yaml": "serve-h200-tp1.yaml",
    "values-h200.yaml": "serve-h200-tp2.yaml",
    "values-mi355x.yaml": "serve-mi355x-tp8.yaml",
}
K8S_VERSIONS = ("1.26.0", kubernetes_validate.latest_version())


@pytest.fixture(scope="module")
def chart():
    loaded = helm_python.Chart.load(CHART)
    yield loaded
    loaded.close()


def overlay(values_file: str) -> dict[str, Any]:
    """The values a `-f values_file` install passes (values.yaml itself: none beyond the defaults)."""
    return {} if values_file == "values.yaml" else yaml.safe_load((CHART / values_file).read_text())


def render(chart, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`helm template rel CHART` with ``values``: manifests by kind (each kind renders once)."""
    out: dict[str, dict[str, Any]] = {}
    for path, text in chart.render(values, name="rel", namespace="llm").items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in out, f"{doc['kind']} rendered twice"
                out[doc["kind"]] = doc
    return out


def _strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema with unknown fields refused, as the API server's strict field validation does
    (``kubectl apply --validate=strict``): objects with ``properties`` get ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: {name: _strict(s) for name, s in v.items()} if k == "properties" else _strict(v)
        for k, v in schema.items()
    }
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(plural: str) -> jsonschema.protocols.Validator:
    crd = yaml.safe_load((CRDS / f"ray.io_{plural}.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def rayservice_schema():
    return crd_validator("rayservices")


@pytest.fixture(scope="module")
def raycluster_schema():
    return crd_validator("rayclusters")


def validate_crd(validator, obj: dict[str, Any]) -> None:
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


# ---- generated files in sync, lint --------------------------------------------------------------------------------
def test_values_schema_is_current():
    assert SCHEMA_PATH.read_text() == schema_json(), "run `python -m cluster.chart_values`"


def test_chart_dashboard_is_the_repo_dashboard():
    assert (CHART / "dashboards" / "flexspec-dashboard.json").read_text() == DASHBOARD_PATH.read_text()


@pytest.mark.parametrize("values_file", PRESETS)
def test_lint(values_file):
    report = helm_python.lint(CHART, overlay(values_file), strict=True, namespace="llm")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_file", PRESETS)
def test_values_spell_out_every_default(chart, values_file):
    """Templates see only what the values files hold: the merged values must carry every ChartValues field
    (list items excepted: their optional fields are guarded in the templates, their sizes required)."""
    merged = chart.merge_values(overlay(values_file))
    dumped = ChartValues.model_validate(merged).model_dump(mode="json")
    for key, value in merged.items():
        if key not in ("serveConfig", "workerGroups"):
            assert value == dumped[key], key
    assert set(merged) == set(dumped)


# ---- rendered manifests validate ------------------------------------------------------------------------------
@pytest.mark.parametrize("values_file", PRESETS)
def test_rendered_manifests_validate(chart, values_file, rayservice_schema, raycluster_schema):
    objs = render(chart, overlay(values_file))
    assert set(objs) == {"RayService", "Service", "ServiceMonitor", "PodMonitor", "ConfigMap"}
    rs = objs["RayService"]
    validate_crd(rayservice_schema, rs)
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": rs["metadata"]["name"]},
        "spec": rs["spec"]["rayClusterConfig"],
    }
    validate_crd(raycluster_schema, cluster)
    for kind in ("Service", "ConfigMap"):
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(objs[kind], version, strict=True)


def test_crd_validation_refuses_unknown_and_mistyped_fields(chart, rayservice_schema):
    rs = render(chart, {})["RayService"]
    typo = copy.deepcopy(rs)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(AssertionError, match="maxReplica"):
        validate_crd(rayservice_schema, typo)
    mistyped = copy.deepcopy(rs)
    mistyped["spec"]["rayClusterConfig"]["autoscalerOptions"]["upscalingMode"] = "Fast"
    with pytest.raises(AssertionError, match="upscalingMode"):
        validate_crd(rayservice_schema, mistyped)


@pytest.mark.parametrize("values_file", PRESETS)
def test_serve_config_is_the_preset_and_loads(chart, values_file, tmp_path):
    """serveConfigV2 passes the loader `flexspec serve` uses (Ray's ServeDeploySchema + ServeArgs) and equals the
    repository's preset, so the chart and configs/ never drift."""
    text = render(chart, overlay(values_file))["RayService"]["spec"]["serveConfigV2"]
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    config = load_serve_config(path)
    preset = load_serve_config(REPO / "configs" / PRESETS[values_file])
    assert config.model_dump() == preset.model_dump()


def test_monitors_select_the_pods_that_serve_metrics(chart):
    objs = render(chart, {})
    rs, svc = objs["RayService"], objs["Service"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    workers = [g["template"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert svc["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    assert not any(svc["spec"]["selector"].items() <= w["metadata"]["labels"].items() for w in workers)
    head_ports = {p["name"] for p in head["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= head_ports
    monitor = objs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("serve", "/metrics")]
    assert {p["name"] for p in svc["spec"]["ports"]} == {"serve"}
    pods = objs["PodMonitor"]
    (endpoint,) = pods["spec"]["podMetricsEndpoints"]
    for template in [head, *workers]:
        assert pods["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    disabled = render(
        chart, {"monitoring": {"serviceMonitor": {"enabled": False}, "podMonitor": {"enabled": False}}}
    )
    assert set(disabled) == {"RayService", "ConfigMap"}


def test_dashboard_configmap_for_grafana_sidecar(chart):
    cm = render(chart, {})["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["flexspec-dashboard.json"]) == json.loads(DASHBOARD_PATH.read_text())


# ---- GPUs and autoscaling ---------------------------------------------------------------------------------------
def _worker(objs: dict[str, Any]) -> dict[str, Any]:
    (group,) = objs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def test_nvidia_h200_workers(chart):
    group = _worker(render(chart, overlay("values-h200.yaml")))
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "amd.com/gpu" not in container["resources"]["limits"]
    assert "HIP_VISIBLE_DEVICES" not in {e["name"] for e in container.get("env", [])}
    assert group["rayStartParams"]["num-gpus"] == "8"
    assert group["resources"] == {"accelerator_type:H200": "1"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_amd_mi355x_workers(chart):
    objs = render(chart, overlay("values-mi355x.yaml"))
    group = _worker(objs)
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["amd.com/gpu"] == 8
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert {"name": "HIP_VISIBLE_DEVICES", "value": "0,1,2,3,4,5,6,7"} in container["env"]
    assert container["image"].endswith("-rocm")
    assert group["resources"] == {"accelerator_type:AMD-Instinct-MI355X-OAM": "1"}
    serve = yaml.safe_load(objs["RayService"]["spec"]["serveConfigV2"])
    assert serve["applications"][0]["args"]["accelerator_type"] == "AMD-Instinct-MI355X-OAM"
    off = overlay("values-mi355x.yaml") | {"gpu": {"vendor": "amd", "setHipVisibleDevices": False}}
    container = _worker(render(chart, off))["template"]["spec"]["containers"][0]
    assert "env" not in container


def test_autoscaling_is_configurable(chart):
    values = overlay("values-h200.yaml")
    values["autoscaler"] = {"upscalingMode": "Aggressive", "idleTimeoutSeconds": 120}
    values["workerGroups"][0] |= {"minReplicas": 1, "maxReplicas": 3}
    values["serveConfig"]["applications"][0]["args"]["deployment"]["autoscaling"] = {
        "min_replicas": 2, "max_replicas": 12, "target_ongoing_requests": 32,
    }  # fmt: skip
    spec = render(chart, values)["RayService"]["spec"]
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] | {"resources": None} == {
        "version": "v2", "upscalingMode": "Aggressive", "idleTimeoutSeconds": 120, "imagePullPolicy": "IfNotPresent",
        "resources": None,
    }  # fmt: skip
    assert (cluster["workerGroupSpecs"][0]["minReplicas"], cluster["workerGroupSpecs"][0]["maxReplicas"]) == (
        1,
        3,
    )
    args = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]
    assert args["deployment"]["autoscaling"] == {
        "min_replicas": 2,
        "max_replicas": 12,
        "target_ongoing_requests": 32,
    }
    off = render(chart, {"autoscaler": {"enabled": False}})["RayService"]["spec"]["rayClusterConfig"]
    assert off["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in off


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"serveConfig": {"applications": [{"name": "a", "args": {"engine": {"max_num_seqs": 0}}}]}},
         "/serveConfig/applications/0/args/engine/max_num_seqs"),
        ({"serveConfig": {"applications": [{"name": "a", "args": {"bogus": 1}}]}}, "bogus"),
        ({"gpu": {"vendor": "intel"}}, "/gpu/vendor"),
        ({"workerGroups": [{"groupName": "g", "replicas": 1, "minReplicas": 0, "maxReplicas": 1}]}, "gpus"),
        ({"autoscaler": {"version": "v3"}}, "/autoscaler/version"),
        ({"replicas": 2}, "replicas"),
    ],
)  # fmt: skip
def test_values_schema_refuses_bad_values(chart, values, message):
    """Helm checks values.schema.json (ServeArgs inside) before rendering anything."""
    with pytest.raises(helm_python.HelmValuesError, match=message):
        chart.render(values, name="rel")
