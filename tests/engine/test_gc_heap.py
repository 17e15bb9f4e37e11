"""An engine freezes its start-up heap (``flexspec.engine.gc_heap``) and never leaks a dropped engine."""

from __future__ import annotations

import gc
import weakref

from configs import EngineConfig, SamplingParams
from flexspec.engine.llm_engine import LLMEngine
from tests.spec.test_mtp import tiny_target  # noqa: F401  (random 2-layer Llama, the default tokenizer)


def _engine(folder) -> LLMEngine:
    # an n-gram drafter's worker reads the engine's token lists: the engine sits in a reference cycle
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    config = EngineConfig(model=str(folder), device="cpu", max_model_len=128, speculative_config=spec)
    return LLMEngine(config)


def test_start_up_heap_is_frozen_and_a_dropped_engine_is_collected(tiny_target):  # noqa: F811
    first = _engine(tiny_target)
    assert gc.get_freeze_count() > 0
    # generations 0-2: what full collections walk (frozen objects are not among them)
    tracked = {id(o) for o in gc.get_objects()}
    assert id(first.scheduler) not in tracked and id(first.executor.runner) not in tracked
    dead = weakref.ref(first)
    del first, tracked
    assert dead() is not None  # in reference cycles: only the collector frees it, and only if not frozen
    second = _engine(tiny_target)  # unfreezes the first engine's objects, then freezes what is still alive
    gc.collect()
    assert dead() is None, "a dropped engine stayed frozen (never collected)"
    out = second.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 5
    gc.unfreeze()
