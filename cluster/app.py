"""The Serve application: ``import_path: cluster.app:build_app`` with ``args`` validated by ``ServeArgs``.

    OpenAIIngress (HTTP, no model)  --streaming handle-->  LLMServer replicas (engine + TP worker group)

``LLMServer`` autoscales; each replica reserves one placement group of ``tensor_parallel_size`` bundles
(``STRICT_PACK``: one node) and starts one ``TPWorker`` per bundle, or runs TP=1 in its own process.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application

from actors.placement import WorkerResources, worker_bundles
from cluster.ingress import OpenAIIngress
from cluster.server import LLMServer
from configs.serve import ServeArgs


def resolve_device(args: ServeArgs) -> ServeArgs:
    """Pin ``engine.device`` (auto -> cuda if the Ray cluster has GPUs) so placement and ranks agree."""
    if args.engine.device != "auto":
        return args
    if not ray.is_initialized():
        ray.init()
    device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    return args.model_copy(update={"engine": args.engine.model_copy(update={"device": device})})


def llm_deployment_options(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the engine deployment: autoscaling, queue limits, resources / placement group."""
    d, a = args.deployment, args.deployment.autoscaling
    autoscaling: dict[str, Any] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
    }
    if a.initial_replicas is not None:
        autoscaling["initial_replicas"] = a.initial_replicas
    opts: dict[str, Any] = {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "backpressure_config": {"status_code": d.backpressure_status_code, "retry_after_s": d.retry_after_s},
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
    }
    res = WorkerResources(args.engine.device == "cuda", args.cpus_per_worker, args.accelerator_type)
    if args.use_local_executor:
        opts["ray_actor_options"] = res.actor_options()  # the replica process is the only rank
    else:
        # The replica itself reserves nothing and sits in bundle 0; rank i's TPWorker takes bundle i.
        opts["ray_actor_options"] = {"num_cpus": 0}
        opts["placement_group_bundles"] = worker_bundles(args.engine.tensor_parallel_size, res)
        opts["placement_group_strategy"] = args.placement_strategy
    return opts


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (``serve run`` / ``serve deploy`` / ``flexspec serve`` call it with ``args``).

    Raises:
        pydantic.ValidationError: invalid args; the message names the field (e.g. ``engine.max_model_len``).
    """
    parsed = resolve_device(args if isinstance(args, ServeArgs) else ServeArgs.model_validate(args or {}))
    llm = serve.deployment(LLMServer, name="LLMServer").options(**llm_deployment_options(parsed)).bind(parsed)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=parsed.ingress.num_replicas,
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": parsed.ingress.num_cpus},
    )
    return ingress.bind(llm, parsed)
