"""Actor tests: one torch thread in-process (``ray_session``, the local Ray cluster, is in tests/conftest.py)."""

from __future__ import annotations

import pytest


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
