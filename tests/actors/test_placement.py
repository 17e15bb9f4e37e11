"""Per-rank bundles and actor options (no Ray needed)."""

from actors.placement import WorkerResources, worker_bundles


def test_cpu_bundles_one_per_rank():
    res = WorkerResources(use_gpu=False, num_cpus=1)
    assert worker_bundles(2, res) == [{"CPU": 1}, {"CPU": 1}]
    assert res.actor_options() == {"num_cpus": 1, "num_gpus": 0}
    assert res.backend == "gloo"


def test_gpu_bundles_carry_accelerator_type():
    res = WorkerResources(use_gpu=True, num_cpus=2, accelerator_type="AMD-Instinct-MI355X-OAM")
    bundles = worker_bundles(8, res)
    assert len(bundles) == 8
    assert bundles[0] == {"CPU": 2, "GPU": 1, "accelerator_type:AMD-Instinct-MI355X-OAM": 0.001}
    opts = res.actor_options()
    assert opts["num_gpus"] == 1 and opts["accelerator_type"] == "AMD-Instinct-MI355X-OAM"
    # The actor must fit in its bundle.
    assert opts["num_cpus"] <= bundles[0]["CPU"] and opts["num_gpus"] <= bundles[0]["GPU"]
    assert res.backend == "nccl"
