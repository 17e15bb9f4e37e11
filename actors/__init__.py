"""Ray actors: one TP worker per GPU (per CPU slot on CPU) and the executor that drives a replica's group."""

from actors.placement import WorkerResources, worker_bundles
from actors.ray_executor import RayExecutor, WorkerGroupError
from actors.tp_worker import TPWorker

__all__ = ["RayExecutor", "TPWorker", "WorkerGroupError", "WorkerResources", "worker_bundles"]
