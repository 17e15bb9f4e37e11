"""Why a ``flexspec serve`` deployment is not ready: what its replicas ask Ray for vs what the cluster's nodes have.

A replica of ``LLMServer`` is one actor (TP=1 in the replica process, ``ray_actor_options``) or one placement
group of ``tensor_parallel_size`` bundles (``STRICT_PACK``: all on one node; ``PACK``: may span nodes); an ingress
replica is one actor. Ray keeps a demand that no node can hold PENDING, silently. On a cluster that cannot grow
(the local one ``flexspec serve`` starts) that is a configuration error: :func:`unplaceable` names what is
missing before anything is deployed. While waiting, :func:`pending_report` lists the replica placement groups
Ray has not placed yet and the deployments' own status messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

Resources = dict[str, float]
BUILDER = "cluster.app:build_app"


@dataclass(frozen=True)
class Demand:
    """What one kind of replica reserves, and how many of them the deployment starts with."""

    what: str  # e.g. "applications.0 (flexspec): LLMServer replica"
    bundles: list[Resources]  # one per placement-group bundle; a plain actor is one bundle
    strategy: str  # "STRICT_PACK" (one node) or "PACK" (bundles may span nodes)
    count: int  # replicas at deploy time


def app_demands(config: Any) -> list[Demand]:
    """Demands of the ``cluster.app:build_app`` applications of a ``ServeDeploySchema`` (needs ``ray.init``:
    ``engine.device: auto`` becomes cuda when the cluster has GPUs, as ``build_app`` decides it).

    A deployment whose resources the file overrides under ``deployments`` is left out (Serve applies the
    override; this module does not model it).
    """
    from cluster.app import llm_deployment_options, resolve_device
    from configs.serve import ServeArgs

    out = []
    for i, app in enumerate(config.applications):
        if app.import_path != BUILDER:
            continue
        overridden = {d.name for d in app.deployments}
        args = resolve_device(ServeArgs.model_validate(app.args or {}))
        where = f"applications.{i} ({app.name})"
        if "LLMServer" not in overridden:
            opts = llm_deployment_options(args)
            a = args.deployment.autoscaling
            count = a.initial_replicas if a.initial_replicas is not None else a.min_replicas
            if "placement_group_bundles" in opts:
                bundles = [dict(b) for b in opts["placement_group_bundles"]]
                strategy = opts["placement_group_strategy"]
            else:
                bundles, strategy = [_actor_resources(opts["ray_actor_options"])], "STRICT_PACK"
            out.append(Demand(f"{where}: LLMServer replica", bundles, strategy, count))
        if "OpenAIIngress" not in overridden and args.ingress.num_cpus > 0:
            out.append(
                Demand(
                    f"{where}: OpenAIIngress replica",
                    [{"CPU": args.ingress.num_cpus}],
                    "STRICT_PACK",
                    args.ingress.num_replicas,
                )
            )
    return out


def _actor_resources(options: dict[str, Any]) -> Resources:
    res: Resources = {"CPU": float(options.get("num_cpus", 1))}
    if options.get("num_gpus"):
        res["GPU"] = float(options["num_gpus"])
    if options.get("accelerator_type"):
        res[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    res.update(options.get("resources") or {})
    return res


def _total(parts: list[Resources]) -> Resources:
    out: Resources = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _lack(need: Resources, have: Resources) -> Resources:
    """What ``have`` lacks of ``need`` (empty when it fits)."""
    return {k: v - have.get(k, 0.0) for k, v in need.items() if v > 0 and have.get(k, 0.0) + 1e-9 < v}


def _closest(need: Resources, nodes: list[Resources]) -> Resources:
    """The shortfall on the node that comes closest to holding ``need`` (everything when there is no node)."""
    lacks = [_lack(need, n) for n in nodes] or [need]
    return min(lacks, key=lambda lack: (len(lack), sum(lack.values())))


def fmt(res: Resources) -> str:
    """``{"CPU": 4.0, "GPU": 1.0}`` -> ``CPU 4, GPU 1``."""

    def num(v: float) -> str:
        return f"{v:g}" if v >= 0.01 else "(any)"

    return ", ".join(f"{k} {num(v)}" for k, v in sorted(res.items())) or "nothing"


def unplaceable(demands: list[Demand], nodes: list[Resources]) -> list[str]:
    """One line per demand this cluster can never hold, naming what is missing; [] when all can be placed.

    ``nodes``: total resources of each alive node (``ray.nodes()``). A ``STRICT_PACK`` replica needs one node with
    the sum of its bundles; a ``PACK`` replica needs each bundle on some node and the sum within the cluster.
    Then all replicas started at deploy time together must fit the cluster's totals.
    """
    problems = []
    for d in demands:
        need = _total(d.bundles)
        shape = (
            f"{len(d.bundles)} bundle(s) of {fmt(d.bundles[0])}, {d.strategy}" if len(d.bundles) > 1 else ""
        )
        what = f"{d.what} needs {fmt(need)}" + (f" ({shape})" if shape else "")
        if d.strategy == "PACK":
            lack: Resources = {}
            for b in d.bundles:
                if lack := _closest(b, nodes):
                    break
            if lack := lack or _lack(need, _total(nodes)):
                problems.append(f"{what}; the cluster lacks {fmt(lack)}")
        elif lack := _closest(need, nodes):
            problems.append(f"{what} on one node; the best node lacks {fmt(lack)}")
    if not problems:
        total_need = _total([{k: v * d.count for k, v in _total(d.bundles).items()} for d in demands])
        if lack := _lack(total_need, _total(nodes)):
            problems.append(
                f"the replicas started at deploy time need {fmt(total_need)} in all; the cluster lacks {fmt(lack)}"
            )
    return problems


def cluster_nodes() -> list[Resources]:
    """Total resources of each alive node of the connected Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def pending_report(app_names: list[str], apps: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What keeps ``app_names`` from running, as ``(unplaceable, waiting)`` lines: replica placement groups Ray
    has not placed that no node can hold (naming what is missing), and the rest (placement groups whose resources
    exist but are in use, the not-yet-healthy deployments' status messages)."""
    from ray.util import placement_group_table

    nodes = cluster_nodes()
    stuck, waiting = [], []
    prefixes = tuple(f"SERVE_REPLICA::{name}#" for name in app_names)
    for pg in placement_group_table().values():
        name = str(pg.get("name", ""))
        if pg.get("state") not in ("PENDING", "RESCHEDULING") or not name.startswith(prefixes):
            continue
        bundles = [dict(b) for b in pg.get("bundles", {}).values()]
        problem = unplaceable(
            [Demand(f"placement group {name}", bundles, pg.get("strategy", "PACK"), 1)], nodes
        )
        if problem:
            stuck += problem
        else:
            waiting.append(
                f"placement group {name} ({fmt(_total(bundles))}) is {pg['state']}: in use elsewhere"
            )
    for app in app_names:
        status = apps.get(app)
        for dep_name, dep in (getattr(status, "deployments", None) or {}).items():
            if not str(dep.status).endswith("HEALTHY") and dep.message:
                waiting.append(f"{app}/{dep_name}: {summarize(dep.message)}")
    return stuck, waiting


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*: \S")  # flexspec.errors.ConfigError: max_model_len ...


def summarize(message: str) -> str:
    """One line of a Serve / Ray message. One that carries a traceback becomes its lead sentence plus the last
    exception line (``flexspec.errors.ConfigError: max_model_len ...``); the full traceback stays in the Serve
    logs."""
    lines = [x.strip() for x in _ANSI.sub("", message).strip().splitlines() if x.strip()]
    if not any("Traceback (most recent call last)" in x for x in lines):
        return " ".join(lines)
    lead = lines[0].split(". ")[0].rstrip(".") + "." if not lines[0].startswith("Traceback") else ""
    exceptions = [x for x in lines if _EXCEPTION_LINE.match(x) and "Traceback (most recent" not in x]
    return " ".join(x for x in (lead, exceptions[-1] if exceptions else lines[-1]) if x)
