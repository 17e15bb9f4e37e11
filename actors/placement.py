"""Placement of one replica's TP ranks: one bundle per rank, in one placement group.

``STRICT_PACK`` keeps the whole group (target shards + co-located drafter shards) on one node, so a replica
never spans nodes unless cross-node TP is asked for explicitly (``PACK``). Ray Serve LLM defaults to ``PACK``,
which may split a replica; we say ``STRICT_PACK`` on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

Bundle = dict[str, float]


@dataclass(frozen=True)
class WorkerResources:
    """What one TP rank reserves."""

    use_gpu: bool
    num_cpus: float = 1.0
    accelerator_type: str | None = None  # e.g. "H200", "AMD-Instinct-MI355X-OAM"

    def bundle(self) -> Bundle:
        """The placement-group bundle of one rank: {"CPU": c} on CPU, {"CPU": c, "GPU": 1} on GPU."""
        b: Bundle = {"CPU": self.num_cpus}
        if self.use_gpu:
            b["GPU"] = 1.0
        if self.accelerator_type:
            # Same custom resource Ray adds for ``.options(accelerator_type=...)``.
            b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return b

    def actor_options(self) -> dict:
        """``ray.remote`` options of the rank's actor (must fit inside its bundle)."""
        opts: dict = {"num_cpus": self.num_cpus, "num_gpus": 1 if self.use_gpu else 0}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    @property
    def backend(self) -> str:
        """torch.distributed backend: NCCL (RCCL on ROCm, same name) on GPU, gloo on CPU."""
        return "nccl" if self.use_gpu else "gloo"


def worker_bundles(tensor_parallel_size: int, resources: WorkerResources) -> list[Bundle]:
    """One bundle per TP rank; bundle i hosts rank i (and, inside Serve, bundle 0 also hosts the replica)."""
    return [resources.bundle() for _ in range(tensor_parallel_size)]
