"""Arguments of the Ray Serve application (``cluster.app:build_app``): what a Serve config file's ``args`` holds.

One schema validates YAML presets (``configs/serve*.yaml``), ``flexspec serve`` and ``serve deploy``; unknown or
mistyped fields fail at load with the field named. The engine part is ``configs.engine.EngineConfig``; the
top-level ``model`` / ``tensor_parallel_size`` / ``speculative_config`` are vLLM-style shortcuts merged into it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from configs.engine import EngineConfig
from configs.speculative import SpeculativeConfig

_SHORTCUTS = ("model", "tensor_parallel_size", "speculative_config")


class AutoscalingArgs(BaseModel):
    """Replica autoscaling (Ray Serve ``autoscaling_config``); one replica = one engine = one TP worker group."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 = scale to zero when idle).")
    max_replicas: int = Field(1, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas at deploy time (default: min_replicas)."
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Ongoing requests per replica the autoscaler aims for."
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Seconds of sustained load before adding replicas."
    )
    downscale_delay_s: float = Field(600.0, ge=0, description="Seconds of low load before removing replicas.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        if (
            self.initial_replicas is not None
            and not self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class DeploymentArgs(BaseModel):
    """Options of the engine deployment (``LLMServer``)."""

    model_config = ConfigDict(extra="forbid")

    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs, description="Replica autoscaling.")
    max_ongoing_requests: int = Field(
        64, gt=0, description="Requests in flight per replica (keep >= engine.max_num_seqs to fill batches)."
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests queued at each caller before rejecting with 503/429 (-1 = unbounded).",
    )
    backpressure_status_code: Literal[429, 503] = Field(503, description="HTTP status of rejected requests.")
    retry_after_s: int = Field(1, ge=0, description="Retry-After header (seconds) on overload responses.")
    health_check_period_s: float = Field(10.0, gt=0, description="Seconds between replica health checks.")
    health_check_timeout_s: float = Field(60.0, gt=0, description="Health check deadline, seconds.")
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0, description="Time to drain a replica on shutdown.")


class IngressArgs(BaseModel):
    """Options of the OpenAI HTTP ingress deployment (``OpenAIIngress``): validation, SSE, errors, metrics."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="Ingress replicas (lightweight; no model).")
    num_cpus: float = Field(0.0, ge=0, description="CPUs reserved per ingress replica.")
    max_ongoing_requests: int = Field(1024, gt=0, description="Concurrent HTTP requests per ingress replica.")
    max_request_bytes: int = Field(
        8 * 2**20, gt=0, description="Largest accepted request body; larger bodies get 413."
    )
    api_key: SecretStr | None = Field(
        None,
        description="Require `Authorization: Bearer <key>` on the /v1 routes (401 otherwise); unset: the "
        "FLEXSPEC_API_KEY environment variable of the ingress replica, else no key. /health stays open.",
    )
    metrics_require_api_key: bool = Field(
        False, description="Also require the API key on /metrics (off: Prometheus scrapes without one)."
    )
    engine_retry_timeout_s: float = Field(
        30.0,
        ge=0,
        description="A request that meets a dead or restarting engine before any token was sent to the "
        "client is retried for up to this long (Serve replaces the replica meanwhile), then gets 503.",
    )


class ServeArgs(BaseModel):
    """Everything ``cluster.app:build_app`` needs to serve one model."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Engine settings (one per replica)."
    )
    model: str | None = Field(None, description="Shortcut for engine.model.")
    tensor_parallel_size: int | None = Field(
        None, ge=1, le=64, description="Shortcut for engine.tensor_parallel_size."
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="Shortcut for engine.speculative_config (vLLM --speculative-config fields)."
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="Model name clients send and /v1/models lists (default: engine.model).",
    )
    executor: Literal["auto", "local", "ray"] = Field(
        "auto",
        description="local = TP1 inside the replica process; ray = one TPWorker actor per rank; "
        "auto = local for TP1, ray otherwise.",
    )
    accelerator_type: str | None = Field(
        None, description="Ray accelerator type the ranks need, e.g. H200 or AMD-Instinct-MI355X-OAM."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK"] = Field(
        "STRICT_PACK",
        description="Placement of one replica's TP ranks: STRICT_PACK keeps them on one node; PACK allows "
        "cross-node tensor parallelism (ask for it explicitly).",
    )
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs per TP rank (and torch threads on CPU).")
    execute_timeout_s: float = Field(
        300.0, gt=0, description="Watchdog: a step whose ranks do not all answer in time fails the replica."
    )
    log_requests: bool = Field(
        False,
        description="Log every request's prompt and sampling parameters (replica log). Off: request logs "
        "carry ids, token counts and statuses only, never prompt or output text.",
    )
    deployment: DeploymentArgs = Field(
        default_factory=DeploymentArgs, description="Engine deployment options."
    )
    ingress: IngressArgs = Field(default_factory=IngressArgs, description="HTTP ingress options.")

    @model_validator(mode="after")
    def _merge_shortcuts(self) -> ServeArgs:
        given = {
            k: getattr(self, k)
            for k in _SHORTCUTS
            if k in self.model_fields_set and getattr(self, k) is not None
        }
        clash = [
            k for k in given if k in self.engine.model_fields_set and getattr(self.engine, k) != given[k]
        ]
        if clash:
            raise ValueError(
                f"{', '.join(clash)} given both at top level and under engine with different values"
            )
        if given:
            # Re-validate so the engine's cross-field checks (e.g. drafter TP = 1 or target TP) see the merge.
            merged = self.engine.model_dump(exclude_unset=True) | {
                k: (v.model_dump() if isinstance(v, BaseModel) else v) for k, v in given.items()
            }
            self.engine = EngineConfig.model_validate(merged)
        if self.executor == "local" and self.engine.tensor_parallel_size > 1:
            raise ValueError(
                "executor 'local' runs TP=1 only; use 'ray' or 'auto' for tensor_parallel_size > 1"
            )
        return self

    @property
    def use_local_executor(self) -> bool:
        """True when the replica runs the model in its own process (TP=1, no worker actors)."""
        if self.executor == "auto":
            return self.engine.tensor_parallel_size == 1
        return self.executor == "local"

    @property
    def model_name(self) -> str:
        """The name clients use in requests."""
        return self.served_model_name or self.engine.model
