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
