"""Helpers for speculative-decoding tests: a plain reference engine and spec engines per config."""

from __future__ import annotations

import contextlib

import pytest

from configs import EngineConfig
from flexspec.engine.llm_engine import LLMEngine


def spec_engine(speculative_config: dict, **overrides) -> LLMEngine:
    args = {"max_model_len": 1024, "device": "cpu", "speculative_config": speculative_config}
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


@pytest.fixture(scope="session")
def plain_128(engine):
    """Plain greedy outputs (128 tokens) of 21 real prompts, computed once per session."""
    from configs import SamplingParams
    from tests.conftest import real_prompts

    prompts = real_prompts(engine, n_each=7)
    outs = engine.generate(prompts, SamplingParams(max_tokens=128, temperature=0))
    return prompts, [o.token_ids for o in outs]


@contextlib.contextmanager
def on_worker_outputs(worker, fn):
    """While active, ``fn(inp, out)`` sees (and may edit) every step output of the speculative ``worker``:
    steps it executes (``execute``) and launched device-side verification steps (``collect``)."""
    execute, collect = worker.execute, worker.collect

    def executed(inp):
        out = execute(inp)
        if out is not None:
            fn(inp, out)
        return out

    def collected(pending):
        out = collect(pending)
        fn(pending.inp, out)
        return out

    worker.execute, worker.collect = executed, collected
    try:
        yield
    finally:
        del worker.execute, worker.collect
