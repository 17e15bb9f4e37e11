"""Values of the Helm chart ``helm/flexspec`` as pydantic models; ``values.schema.json`` is generated from them.

One schema drives the CLI, the YAML presets and the chart (STYLE.md habit 3): ``serveConfig`` is Ray's
``ServeDeploySchema`` whose applications' ``args`` are ``configs.serve.ServeArgs``, so ``helm install`` rejects a
bad engine field (e.g. ``engine.max_num_seqs: 0``) before anything starts, as ``flexspec serve`` does.

Regenerate the schema after changing these models or ``ServeArgs``::

    python -m cluster.chart_values            # writes helm/flexspec/values.schema.json

Autoscaling has two levels (README "Operations"): Ray Serve adds / removes ``LLMServer`` replicas to keep
``target_ongoing_requests`` per replica (``serveConfig...deployment.autoscaling``); each new replica asks for a
placement group of ``tensor_parallel_size`` GPU bundles, and when no node has room the Ray autoscaler (``autoscaler``
below, KubeRay in-tree autoscaler v2) adds worker pods of a group that fits the pending placement group, up to that
group's ``maxReplicas``, and removes pods idle for ``idleTimeoutSeconds``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from cluster.launcher import BUILDER
from configs.serve import ServeArgs

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "helm" / "flexspec" / "values.schema.json"
Quantity = str | int  # a Kubernetes resource quantity: "16", "128Gi", 8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FlexspecApplication(ServeApplicationSchema):
    """One Serve application running ``cluster.app:build_app``; ``args`` are ``ServeArgs``."""

    model_config = ConfigDict(extra="forbid")

    import_path: Literal["cluster.app:build_app"] = Field(BUILDER, description="The flexspec app builder.")
    args: ServeArgs = Field(default_factory=ServeArgs, description="flexspec ServeArgs (configs/serve.py).")


class ServeConfig(ServeDeploySchema):
    """What ``serveConfigV2`` holds: a Serve config file (``configs/serve*.yaml``) of flexspec applications."""

    model_config = ConfigDict(extra="forbid")

    applications: list[FlexspecApplication] = Field(..., min_length=1, description="flexspec applications.")


class Image(_Strict):
    """Container image with Ray 2.60 and flexspec (``pip install '.[serve]'``) for the accelerator's torch."""

    repository: str = Field(..., min_length=1, description="Image repository.")
    tag: str = Field(..., min_length=1, description="Image tag.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy.")


class Gpu(_Strict):
    """Accelerator vendor of the worker pods."""

    vendor: Literal["nvidia", "amd"] = Field(
        "nvidia", description="nvidia -> nvidia.com/gpu; amd -> amd.com/gpu."
    )
    setHipVisibleDevices: bool = Field(
        True,
        description="amd only: export HIP_VISIBLE_DEVICES=0..n-1 (the pod's GPUs) in worker pods. Ray isolates "
        "each rank's GPU through HIP_VISIBLE_DEVICES and refuses to start when only ROCR_VISIBLE_DEVICES is set.",
    )


class HeadGroup(_Strict):
    """The Ray head pod: GCS, dashboard, Serve controller and HTTP proxy; no GPU, no engine replica."""

    cpu: Quantity = Field(4, description="CPU request and limit.")
    memory: Quantity = Field("16Gi", description="Memory request and limit.")
    rayStartParams: dict[str, str] = Field(
        default_factory=lambda: {"num-cpus": "0"},
        description="Extra `ray start` flags; num-cpus 0 keeps replicas off the head.",
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    env: list[dict[str, Any]] = Field(default_factory=list, description="Extra container env entries.")


class WorkerGroup(_Strict):
    """A group of identical GPU worker pods; one pod per node, all its GPUs to Ray.

    Sizes have no defaults: Helm applies no defaults inside list items, so the schema makes them required.
    """

    groupName: str = Field(..., pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Group name.")
    replicas: int = Field(..., ge=0, description="Pods at start (the autoscaler moves it within min/max).")
    minReplicas: int = Field(..., ge=0, description="Fewest pods the autoscaler keeps.")
    maxReplicas: int = Field(..., ge=1, description="Most pods the autoscaler adds.")
    gpus: int = Field(..., ge=1, description="GPUs per pod (nvidia.com/gpu or amd.com/gpu limit).")
    cpu: Quantity = Field(..., description="CPU request and limit.")
    memory: Quantity = Field(..., description="Memory request and limit.")
    sharedMemory: Quantity = Field(..., description="Size of /dev/shm (NCCL/RCCL and Ray's object store).")
    rayStartParams: dict[str, str] = Field(default_factory=dict, description="Extra `ray start` flags.")
    rayResources: dict[str, str] = Field(
        default_factory=dict,
        description="Custom Ray resources per pod, known to the autoscaler before a pod exists; set "
        "accelerator_type:<type> = 1 when serveConfig names an accelerator_type.",
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="Pod nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Pod tolerations.")
    env: list[dict[str, Any]] = Field(default_factory=list, description="Extra container env entries.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra pod volumes (model weights)."
    )
    volumeMounts: list[dict[str, Any]] = Field(
        default_factory=list, description="Extra container volume mounts."
    )


class Autoscaler(_Strict):
    """KubeRay's in-tree Ray autoscaler: adds worker pods for pending placement groups, removes idle ones."""

    enabled: bool = Field(True, description="enableInTreeAutoscaling.")
    version: Literal["v1", "v2"] = Field("v2", description="Autoscaler version (v2: placement-group aware).")
    upscalingMode: Literal["Default", "Aggressive", "Conservative"] = Field(
        "Default", description="How fast pods are added for pending demand."
    )
    idleTimeoutSeconds: int = Field(300, ge=0, description="Seconds a worker pod idles before removal.")
    cpu: Quantity = Field("500m", description="Autoscaler sidecar CPU.")
    memory: Quantity = Field("512Mi", description="Autoscaler sidecar memory.")


class ServiceMonitor(_Strict):
    """Prometheus Operator ``ServiceMonitor`` for the app's ``/metrics`` (vllm:* and flexspec:* series)."""

    enabled: bool = Field(True, description="Render the metrics Service and its ServiceMonitor.")
    interval: str = Field("15s", description="Scrape interval.")
    scrapeTimeout: str = Field("10s", description="Scrape timeout.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels the Prometheus selects on.")


class PodMonitor(_Strict):
    """Prometheus Operator ``PodMonitor`` for Ray's own metrics export (``ray_*``, port 8080) on every pod."""

    enabled: bool = Field(True, description="Render the PodMonitor.")
    interval: str = Field("15s", description="Scrape interval.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels the Prometheus selects on.")


class Monitoring(_Strict):
    """Prometheus scraping (monitoring.coreos.com/v1 resources)."""

    serviceMonitor: ServiceMonitor = Field(default_factory=ServiceMonitor, description="App metrics.")
    podMonitor: PodMonitor = Field(default_factory=PodMonitor, description="Ray system metrics.")


class GrafanaDashboard(_Strict):
    """The dashboard (``cluster/dashboard.py``) as a ConfigMap that Grafana's dashboard sidecar loads."""

    enabled: bool = Field(True, description="Render the dashboard ConfigMap.")
    labels: dict[str, str] = Field(
        default_factory=lambda: {"grafana_dashboard": "1"}, description="Labels the sidecar watches."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="e.g. the sidecar's folder annotation."
    )


class ChartValues(_Strict):
    """Everything ``helm/flexspec`` renders from: one KubeRay RayService plus monitoring objects."""

    nameOverride: str = Field("", description="Replaces the chart name in resource names.")
    fullnameOverride: str = Field("", description="Replaces the full resource name.")
    rayVersion: str = Field("2.60.0", description="Ray version of the image (KubeRay rayVersion).")
    image: Image = Field(..., description="Ray + flexspec image of every pod.")
    gpu: Gpu = Field(default_factory=Gpu, description="Accelerator vendor.")
    auth: Literal["disabled", "token"] = Field(
        "token", description="Ray token authentication (Ray 2.60 default; KubeRay creates the token secret)."
    )
    head: HeadGroup = Field(default_factory=HeadGroup, description="Ray head pod.")
    workerGroups: list[WorkerGroup] = Field(..., min_length=1, description="GPU worker groups.")
    autoscaler: Autoscaler = Field(default_factory=Autoscaler, description="Ray autoscaler (pods).")
    serveConfig: ServeConfig = Field(..., description="serveConfigV2: a flexspec Serve config file.")
    monitoring: Monitoring = Field(default_factory=Monitoring, description="Prometheus Operator objects.")
    grafanaDashboard: GrafanaDashboard = Field(
        default_factory=GrafanaDashboard, description="Dashboard ConfigMap."
    )


def values_schema() -> dict[str, Any]:
    """JSON schema of the chart's values (what Helm checks ``values.schema.json`` against)."""
    schema = ChartValues.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def schema_json() -> str:
    """Stable text of ``values.schema.json``."""
    return json.dumps(values_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(schema_json())
    print(SCHEMA_PATH)
