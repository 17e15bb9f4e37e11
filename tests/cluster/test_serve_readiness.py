"""``flexspec serve`` while the app is not ready: demands no node can hold are named (and fail at once on the local
cluster, which cannot grow), Serve's failure messages shrink to one line, and the wait ends with a message.
Ray is faked here; tests/cluster/test_flexspec_serve_cli.py runs the real thing."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cluster import launcher
from cluster.readiness import Demand, app_demands, summarize, unplaceable
from configs.serve import ServeArgs

GPU_NODE = {"CPU": 16.0, "GPU": 1.0, "memory": 1e11}


def test_strict_pack_needs_one_node_that_holds_every_bundle():
    tp2 = Demand("LLMServer replica", [{"CPU": 1.0, "GPU": 1.0}] * 2, "STRICT_PACK", 1)
    (problem,) = unplaceable([tp2], [GPU_NODE, GPU_NODE])
    assert problem == (
        "LLMServer replica needs CPU 2, GPU 2 (2 bundle(s) of CPU 1, GPU 1, STRICT_PACK) on one node; "
        "the best node lacks GPU 1"
    )
    assert unplaceable([tp2], [GPU_NODE | {"GPU": 2.0}]) == []
    # PACK may span nodes: two one-GPU nodes hold it.
    assert unplaceable([Demand("r", tp2.bundles, "PACK", 1)], [GPU_NODE, GPU_NODE]) == []


def test_no_node_with_the_accelerator_type():
    res = {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H200": 0.001}
    (problem,) = unplaceable([Demand("r", [res], "STRICT_PACK", 1)], [GPU_NODE])
    assert problem.endswith("the best node lacks accelerator_type:H200 (any)")


def test_replicas_at_deploy_time_must_fit_together():
    one = Demand("LLMServer replica", [{"CPU": 2.0}], "STRICT_PACK", 2)
    (problem,) = unplaceable([one], [{"CPU": 2.0}])
    assert problem == "the replicas started at deploy time need CPU 4 in all; the cluster lacks CPU 2"
    # min_replicas 0: nothing starts at deploy time, but a replica that can never be placed is still named.
    assert unplaceable([Demand("x", [{"CPU": 2.0}], "STRICT_PACK", 0)], [{"CPU": 2.0}]) == []
    assert unplaceable([Demand("x", [{"CPU": 4.0}], "STRICT_PACK", 0)], [{"CPU": 2.0}]) != []


def test_demands_follow_the_deployment_options():
    cfg = SimpleNamespace(
        applications=[
            SimpleNamespace(
                name="a",
                import_path="cluster.app:build_app",
                deployments=[],
                args={
                    "engine": {"device": "cpu"},
                    "tensor_parallel_size": 2,
                    "cpus_per_worker": 3,
                    "deployment": {"autoscaling": {"min_replicas": 2, "max_replicas": 4}},
                    "ingress": {"num_cpus": 0.5},
                },
            ),
            SimpleNamespace(name="b", import_path="other:app", deployments=[], args={}),
        ]
    )
    llm, ingress = app_demands(cfg)
    assert (llm.bundles, llm.strategy, llm.count) == ([{"CPU": 3.0}] * 2, "STRICT_PACK", 2)
    assert (ingress.bundles, ingress.count) == ([{"CPU": 0.5}], 1)
    # A deployment whose resources the file overrides is not modelled.
    cfg.applications[0].deployments = [SimpleNamespace(name="LLMServer")]
    assert [d.what for d in app_demands(cfg)] == ["applications.0 (a): OpenAIIngress replica"]
    assert ServeArgs.model_validate(cfg.applications[0].args).use_local_executor is False


def test_summarize_keeps_the_lead_and_the_exception():
    message = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor. "
        "Error: \x1b[36mray::ServeReplica:flexspec:LLMServer.initialize_and_get_metadata()\x1b[39m (pid=1)\n"
        '  File "replica.py", line 1928, in initialize\n    raise RuntimeError(traceback.format_exc()) from None\n'
        "RuntimeError: Traceback (most recent call last):\n"
        '  File "model_runner.py", line 72, in __init__\n    raise ConfigError(\n'
        "flexspec.errors.ConfigError: max_model_len 100000 exceeds the model's max_position_embeddings 8192\n"
    )
    assert summarize(message) == (
        "The deployment failed to start 3 times in a row. flexspec.errors.ConfigError: max_model_len 100000 "
        "exceeds the model's max_position_embeddings 8192"
    )
    assert summarize("Deploying.\nWaiting for replicas.") == "Deploying. Waiting for replicas."


# ---- _wait_ready with a fake Serve ------------------------------------------------------------------------------
def _status(app_status: str, message: str = "", deployments: dict | None = None):
    app = SimpleNamespace(
        status=f"ApplicationStatus.{app_status}", message=message, deployments=deployments or {}
    )
    return SimpleNamespace(applications={"flexspec": app})


@pytest.fixture
def fake_serve(monkeypatch):
    from ray import serve

    state = {"status": _status("DEPLOYING"), "report": ([], [])}
    monkeypatch.setattr(serve, "status", lambda: state["status"])
    monkeypatch.setattr(launcher, "pending_report", lambda names, apps: state["report"])
    return state


STUCK = (
    "placement group SERVE_REPLICA::flexspec#LLMServer#x needs CPU 64 on one node; the best node lacks CPU 62"
)


def test_unplaceable_on_the_local_cluster_fails_after_the_grace_period(fake_serve, capsys):
    fake_serve["report"] = ([STUCK], [])
    code = launcher._wait_ready(["flexspec"], threading.Event(), timeout_s=1800, grace_s=0)
    assert code == 1
    assert (
        capsys.readouterr().err.strip() == f"error: cannot place the deployment on this Ray cluster: {STUCK}"
    )


def test_a_cluster_that_can_grow_is_waited_for_then_times_out(fake_serve, capsys):
    fake_serve["report"] = (
        [STUCK],
        ["flexspec/LLMServer: 1 replica has taken more than 30s to be scheduled."],
    )
    code = launcher._wait_ready(["flexspec"], threading.Event(), timeout_s=1.5, can_grow=True, grace_s=0)
    assert code == 1
    out = capsys.readouterr()
    assert out.out.startswith("flexspec: not ready after 0s: " + STUCK)
    assert out.err.startswith(f"error: not ready after 2s: flexspec: DEPLOYING; {STUCK}; flexspec/LLMServer")


def test_resources_in_use_keep_it_waiting(fake_serve, capsys):
    fake_serve["report"] = ([], ["placement group SERVE_REPLICA::flexspec#LLMServer#x (CPU 2) is PENDING"])
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    assert launcher._wait_ready(["flexspec"], stop, timeout_s=1800, grace_s=0) == 0  # stopped, not failed
    assert "is PENDING" in capsys.readouterr().out


def test_failed_deployment_is_one_line(fake_serve, capsys):
    dep = SimpleNamespace(
        status="DeploymentStatus.DEPLOY_FAILED",
        message="The deployment failed to start 3 times in a row. Error:\nTraceback (most recent call last):\n"
        "  File \"x.py\", line 1\nflexspec.errors.ModelNotFoundError: unknown model 'x'\n",
    )
    fake_serve["status"] = _status(
        "DEPLOY_FAILED", "Failed to update the deployments ['LLMServer'].", {"LLMServer": dep}
    )
    assert launcher._wait_ready(["flexspec"], threading.Event(), timeout_s=1800) == 1
    assert capsys.readouterr().err == (
        "error: deployment failed: flexspec: Failed to update the deployments ['LLMServer']. LLMServer: The "
        "deployment failed to start 3 times in a row. flexspec.errors.ModelNotFoundError: unknown model 'x'\n"
    )
