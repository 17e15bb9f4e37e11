"""Code under test that sets torch's thread count for its process (a Serve replica's ``build_engine``) must not
change it for the tests after it (``tests/conftest.py: _keep_torch_threads``; session 46: half the suite ran on
one thread of two). The two tests run in file order."""

from __future__ import annotations

import torch

from configs import EngineConfig
from tests.conftest import RUN_THREADS
from tests.spec.test_mtp import tiny_target  # noqa: F401  (random 2-layer Llama, the default tokenizer)


def test_a_serve_replica_built_in_process_sets_the_thread_count(tiny_target):  # noqa: F811
    from cluster.server import build_engine
    from configs.serve import ServeArgs
    from flexspec.engine.gc_heap import release_frozen

    assert torch.get_num_threads() == RUN_THREADS
    args = ServeArgs(
        engine=EngineConfig(model=str(tiny_target), device="cpu", max_model_len=128),
        executor="local",
        cpus_per_worker=RUN_THREADS + 1,
    )
    try:
        build_engine(args)
        assert torch.get_num_threads() == RUN_THREADS + 1  # the replica's own setting, for its process
    finally:
        release_frozen()


def test_b_the_next_test_runs_on_the_run_s_thread_count():
    assert torch.get_num_threads() == RUN_THREADS
