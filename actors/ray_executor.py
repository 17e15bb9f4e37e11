"""RayExecutor: the engine's ``Executor`` over one ``TPWorker`` actor per tensor-parallel rank.

Every step the driver puts the ``ModelInput`` once in the object store and hands the same reference to every
rank, so all ranks see one decision (batch, execution mode, draft tokens): ranks that disagree would deadlock
in their collectives. Rank 0's ``ModelOutput`` is returned. A watchdog bounds every wait: a dead rank raises
``WorkerGroupError`` at once, a hung one after ``execute_timeout_s``, instead of hanging the replica.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    remove_placement_group,
)
from ray.util.placement_group import placement_group as create_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.placement import WorkerResources, worker_bundles
from actors.tp_worker import TPWorker
from configs.engine import EngineConfig
from flexspec.engine.model_input import ModelInput, ModelOutput
from flexspec.errors import WorkerGroupError
from flexspec.models.loader import resolve_model_dir

log = logging.getLogger(__name__)

__all__ = ["RayExecutor", "WorkerGroupError", "resolve_use_gpu"]  # WorkerGroupError: from flexspec.errors


def resolve_use_gpu(config: EngineConfig) -> bool:
    """cuda -> GPU ranks, cpu -> CPU ranks, auto -> GPU ranks if the Ray cluster has GPUs now."""
    if config.device != "auto":
        return config.device == "cuda"
    return ray.cluster_resources().get("GPU", 0) > 0


class RayExecutor:
    """Runs one replica's TP ranks as Ray actors in one placement group.

    Args:
        config: the engine config (``tensor_parallel_size`` ranks are started).
        resources: per-rank resources (default: GPU if ``config.device`` says so / the cluster has GPUs).
        placement_group: run ranks in this group; default: the caller's (a Serve replica with
            ``placement_group_bundles``) or, outside one, a new ``strategy`` group owned and removed by us.
        strategy: placement strategy of a group we create (``STRICT_PACK`` = one node).
        execute_timeout_s: watchdog per step; ``init_timeout_s``: for start-up (model load, KV allocation).
            The ranks' ``torch.distributed`` collectives time out too (after ``max(execute_timeout_s, 60)``
            seconds), so a rank stuck in a collective whose peer hung gives up instead of waiting forever.
        name: prefix of the rank actors' names (``{name}-rank{i}``, e.g. the Serve replica id) so operators
            can find them (``ray list actors``); None = unnamed.
    """

    def __init__(
        self,
        config: EngineConfig,
        resources: WorkerResources | None = None,
        placement_group: PlacementGroup | None = None,
        strategy: str = "STRICT_PACK",
        execute_timeout_s: float = 300.0,
        init_timeout_s: float = 1200.0,
        name: str | None = None,
    ) -> None:
        tp = config.tensor_parallel_size
        self.resources = resources or WorkerResources(use_gpu=resolve_use_gpu(config))
        # Pin the device so every rank resolves it the same way whatever it sees.
        self.config = config.model_copy(update={"device": "cuda" if self.resources.use_gpu else "cpu"})
        self.execute_timeout_s = execute_timeout_s
        self.name = name
        self.workers: list[Any] = []
        self._owns_pg = False
        self._broken: str | None = None

        # Convert GGUF -> safetensors once here (the tokenizer needs the folder too) instead of racing in ranks.
        resolve_model_dir(config.model)

        pg = placement_group or get_current_placement_group()
        if pg is None:
            bundles = worker_bundles(tp, self.resources)
            total = ray.cluster_resources()
            for key in bundles[0]:
                need = sum(b[key] for b in bundles)
                if total.get(key, 0.0) < need:
                    raise WorkerGroupError(
                        f"tensor_parallel_size={tp} needs {need:g} {key} in the Ray cluster, which has "
                        f"{total.get(key, 0.0):g}"
                    )
            pg = create_placement_group(bundles, strategy=strategy)
            self._owns_pg = True
            self._gather([pg.ready()], init_timeout_s, "placement group ready")
        self.placement_group = pg
        try:
            self._start_workers(tp, strategy, init_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, tp: int, strategy: str, timeout_s: float) -> None:
        actor_cls = ray.remote(TPWorker)
        for rank in range(tp):
            sched = PlacementGroupSchedulingStrategy(
                self.placement_group,
                placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False,
            )
            named = {"name": f"{self.name}-rank{rank}"} if self.name else {}
            w = actor_cls.options(  # max_concurrency=2: a health-check ping answers while a step runs
                **self.resources.actor_options(),
                **named,
                scheduling_strategy=sched,
                max_restarts=0,
                max_concurrency=2,
            ).remote(rank, tp, num_threads=max(1, int(self.resources.num_cpus)))
            self.workers.append(w)
        t0 = time.perf_counter()
        host, port = self._gather(
            [self.workers[0].rendezvous_address.remote(loopback=strategy == "STRICT_PACK")],
            timeout_s,
            "rendezvous",
        )[0]
        backend = self.resources.backend
        collective_timeout_s = max(self.execute_timeout_s, 60.0)
        self._gather(
            [w.init_distributed.remote(host, port, backend, collective_timeout_s) for w in self.workers],
            timeout_s,
            "init",
        )
        infos = self._gather(
            [w.load_model.remote(self.config) for w in self.workers], timeout_s, "load_model"
        )
        blocks = self._gather(
            [w.allocate_kv_cache.remote() for w in self.workers], timeout_s, "allocate_kv_cache"
        )
        if len(set(blocks)) > 1:  # GPU memory differs per rank: every rank must hold the same block ids
            n = min(blocks)
            blocks = self._gather(
                [w.allocate_kv_cache.remote(n) for w in self.workers], timeout_s, "allocate"
            )
        self.num_kv_blocks: int = blocks[0]
        self.model_dir: str = infos[0]["model_dir"]
        self.spec = infos[0]["spec"]
        self.device_type: str = str(infos[0]["device"]).split(":")[0]  # "cuda" | "cpu"
        log.info(
            "started %d TP ranks (%s, %s) in %.1fs: %d KV blocks",
            tp,
            backend,
            infos[0]["device"],
            time.perf_counter() - t0,
            self.num_kv_blocks,
        )

    # ---- Executor protocol ----------------------------------------------------------------------------------
    def execute(self, inp: ModelInput) -> ModelOutput:
        """Broadcast ``inp`` to every rank, run them concurrently, return rank 0's output."""
        ref = ray.put(inp) if len(self.workers) > 1 else inp
        out = self._gather([w.execute.remote(ref) for w in self.workers], self.execute_timeout_s, "execute")[
            0
        ]
        assert out is not None  # rank 0 always answers
        return out

    def collective_rpc(
        self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``ModelRunner.<method>(*args, **kwargs)`` on every rank; returns the per-rank results."""
        refs = [w.call.remote(method, *args, **kwargs) for w in self.workers]
        return self._gather(refs, timeout_s or self.execute_timeout_s, method)

    def check_health(self, timeout_s: float = 10.0) -> None:
        """Raise ``WorkerGroupError`` unless every rank answers a ping within ``timeout_s`` (a dead rank fails
        at once). A failure marks the group broken, so the next step fails fast too."""
        self._gather([w.ping.remote() for w in self.workers], timeout_s, "health check")

    def shutdown(self) -> None:
        """Kill the ranks and, if we created it, remove the placement group. Safe to call twice."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                log.debug("rank already gone", exc_info=True)
        self.workers = []
        if self._owns_pg and self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                log.debug("placement group already removed", exc_info=True)
            self.placement_group = None

    # ---- watchdog -------------------------------------------------------------------------------------------
    def _gather(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """``ray.get`` with a deadline; a failed or dead rank raises as soon as it is known, not at the end."""
        if self._broken:
            raise WorkerGroupError(f"worker group is broken ({self._broken}); the replica must restart")
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ranks = [refs.index(r) for r in pending]
                    raise GetTimeoutError(f"ranks {ranks} did not answer {what} within {timeout_s:.0f}s")
                ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
                for r in ready:
                    ray.get(r)  # raises now if this rank failed
            return ray.get(refs)
        except (GetTimeoutError, RayActorError, RayError) as e:
            self._broken = f"{what}: {type(e).__name__}"
            raise WorkerGroupError(f"TP worker group failed during {what}: {e}") from e
