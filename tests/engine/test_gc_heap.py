"""``flexspec.engine.gc_heap``: a frozen engine is out of the collector's walks, and ``release_frozen`` is what
lets a dropped (frozen) engine be collected."""

from __future__ import annotations

import gc
import weakref

from configs import EngineConfig, SamplingParams
from flexspec.engine.gc_heap import freeze_long_lived, release_frozen
from flexspec.engine.llm_engine import LLMEngine
from tests.spec.test_mtp import tiny_target  # noqa: F401  (random 2-layer Llama, the default tokenizer)


def test_frozen_engine_is_skipped_and_collected_only_after_release(tiny_target):  # noqa: F811
    # an n-gram drafter's worker reads the engine's token lists: the engine sits in a reference cycle
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    engine = LLMEngine(
        EngineConfig(model=str(tiny_target), device="cpu", max_model_len=128, speculative_config=spec)
    )
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() > 0
        # generations 0-2: what full collections walk (frozen objects are not among them)
        tracked = {id(o) for o in gc.get_objects()}
        assert id(engine.scheduler) not in tracked and id(engine.executor.runner) not in tracked
        del tracked
        out = engine.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 5
        dead = weakref.ref(engine)
        del engine, out
        gc.collect()
        assert dead() is not None, "frozen: a collection alone must not reach it"
        release_frozen()
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert dead() is None, "after release_frozen a dropped engine is collected"
    finally:
        release_frozen()


def test_benchmark_memory_release_unfreezes(tiny_target):  # noqa: F811
    from bench.engine_load import release_device_memory

    spec = {"method": "ngram", "num_speculative_tokens": 3}  # in a reference cycle (as above)
    engine = LLMEngine(
        EngineConfig(model=str(tiny_target), device="cpu", max_model_len=128, speculative_config=spec)
    )
    freeze_long_lived()
    dead = weakref.ref(engine)
    del engine
    release_device_memory()
    assert dead() is None and gc.get_freeze_count() == 0


def test_serve_replica_engine_is_frozen(tiny_target):  # noqa: F811
    from cluster.server import build_engine
    from configs.serve import ServeArgs

    release_frozen()
    args = ServeArgs(
        engine=EngineConfig(model=str(tiny_target), device="cpu", max_model_len=128), executor="local"
    )
    engine = build_engine(args)
    try:
        assert gc.get_freeze_count() > 0 and id(engine.scheduler) not in {id(o) for o in gc.get_objects()}
    finally:
        release_frozen()


def test_tp_worker_freezes_its_shard(tiny_target):  # noqa: F811
    from actors.tp_worker import TPWorker

    release_frozen()
    worker = TPWorker(rank=0, world_size=1)  # sets 1 thread outside Ray (tests/conftest.py restores it)
    try:
        worker.load_model(EngineConfig(model=str(tiny_target), device="cpu", max_model_len=128))
        assert gc.get_freeze_count() > 0 and id(worker.runner) not in {id(o) for o in gc.get_objects()}
    finally:
        release_frozen()
