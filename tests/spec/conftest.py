"""Helpers for speculative-decoding tests: spec engines per config (the plain reference outputs, ``plain_128``,
are in tests/conftest.py: tests/engine uses them too)."""

from __future__ import annotations

import contextlib

from configs import EngineConfig
from flexspec.engine.llm_engine import LLMEngine

# Raw (no chat template) prompts of the GPU spec tests: a word problem, code, prose, an explanation, a list.
RAW_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in all?",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50 and explain how you checked them.",
]


def spec_engine(speculative_config: dict, **overrides) -> LLMEngine:
    args = {"max_model_len": 1024, "device": "cpu", "speculative_config": speculative_config}
    args.update(overrides)
    return LLMEngine(EngineConfig(**args))


def histories_after(worker, inp, out) -> dict[int, list[int]]:
    """Seq id -> committed tokens after the step ``inp`` whose output ``out`` the worker just returned (as
    ``on_worker_outputs`` hands them over), for each emitting sequence: the engine's tokens up to the step's
    committed inputs (its query less its drafts) + the emitted ones. A device-side step leaves the worker's own
    histories stale (taken from the engine when next read), so oracles read the engine's; without a token source
    (a TP worker's process) the worker's history is up to date."""
    rows = iter(out.token_ids)
    hists = {}
    for sid, ctx, q, d, emits in zip(
        inp.seq_ids, inp.context_lens, inp.query_lens, inp.num_draft_tokens, inp.samples
    ):
        if emits:
            emitted = next(rows)
            source = worker.token_source(sid) if worker.token_source is not None else None
            hists[sid] = worker.history[sid] if source is None else source[: ctx + q - d] + list(emitted)
    return hists


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
