"""Ray for the actor tests: one local 2-CPU cluster per session, shared with tests/cluster if it runs too."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A fresh local Ray cluster (``address="local"``: never a stale one left behind by ``ray stop``)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="package", autouse=True)
def _single_torch_thread():
    """Reference engines in this process run on one torch thread, restored afterwards.

    The Ray workers / Serve replica of these tests already use the 2 cores; with 2 OpenMP threads the
    in-process reference was measured 10-20x slower on a busy 2-core machine (barrier waits), 1 thread is not.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
