"""TPWorker: one tensor-parallel rank of one replica, run as a Ray actor (one per GPU, one per CPU slot on CPU).

The worker joins a ``torch.distributed`` group (NCCL on GPU, which is RCCL on ROCm through the same API; gloo on
CPU), builds its ``ModelRunner`` shard (target + co-located drafter shard once the engine builds one), allocates
its KV cache and then executes whatever ``ModelInput`` the driver broadcasts. Every rank runs every step; rank 0
returns the ``ModelOutput``. The class is plain Python: ``RayExecutor`` wraps it with ``ray.remote``, and the
tests can drive it without Ray.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from configs.engine import EngineConfig
from flexspec.distributed import TPGroup
from flexspec.engine.model_input import ModelInput, ModelOutput

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TPWorker:
    """Rank ``rank`` of a ``world_size``-way tensor-parallel group.

    Args:
        rank: this worker's TP rank; rank 0 samples and answers.
        world_size: TP degree of the replica.
        num_threads: torch intra-op threads (CPU ranks; defaults to the CPUs Ray assigned, at least 1).
    """

    def __init__(self, rank: int, world_size: int, num_threads: int | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.runner: Any = None  # flexspec.engine.model_runner.ModelRunner once load_model ran
        if num_threads is None:
            num_threads = max(1, int(_assigned_cpus()))
        torch.set_num_threads(num_threads)

    # ---- setup (called once, in order, by RayExecutor) ----------------------------------------------------
    def rendezvous_address(self, loopback: bool) -> tuple[str, int]:
        """Address for ``init_process_group``: loopback when all ranks share this node, else the node's IP."""
        host = "127.0.0.1" if loopback else _node_ip()
        return host, free_port(host)

    def init_distributed(self, host: str, port: int, backend: str, timeout_s: float = 600.0) -> None:
        """Join the TP group. All ranks must call this concurrently (it blocks until every rank joined).

        ``timeout_s`` bounds the rendezvous and every later collective of the group (gloo / NCCL watchdog):
        a rank whose peer died or hung raises instead of blocking forever.
        """
        if self.world_size == 1:
            return
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU as device 0
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    def load_model(self, config: EngineConfig) -> dict[str, Any]:
        """Build this rank's ModelRunner shard. Returns what the driver needs (model folder, spec). The rank's
        process lives as long as its shard: its start-up heap is frozen (``flexspec.engine.gc_heap``), so full
        garbage collections (one rank's stall holds up every rank's collectives) skip it."""
        from flexspec.engine.gc_heap import freeze_long_lived
        from flexspec.engine.model_runner import ModelRunner

        group = dist.group.WORLD if self.world_size > 1 else None
        self.runner = ModelRunner(config, tp=TPGroup(self.rank, self.world_size, group))
        freeze_long_lived()
        return {
            "model_dir": str(self.runner.model_dir),
            "spec": self.runner.spec,
            "device": str(self.runner.device),
            "load_seconds": self.runner.load_seconds,
        }

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the KV cache (optionally forcing ``num_blocks`` so all ranks agree). Returns blocks."""
        if num_blocks is not None:
            self.runner.config = self.runner.config.model_copy(update={"num_kv_blocks": num_blocks})
        return self.runner.allocate_kv_cache()

    # ---- per step -------------------------------------------------------------------------------------------
    def execute(self, inp: ModelInput) -> ModelOutput | None:
        """Run one step's forward (+ sampling on rank 0). All ranks must get the same ``inp``."""
        return self.runner.execute(inp)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``ModelRunner.<method>`` on this rank (``RayExecutor.collective_rpc`` calls it on every rank)."""
        return getattr(self.runner, method)(*args, **kwargs)

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _assigned_cpus() -> float:
    try:
        import ray

        if ray.is_initialized():
            return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0))
    except Exception:
        log.debug("no Ray runtime context", exc_info=True)
    return 1.0


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return socket.gethostbyname(socket.gethostname())
