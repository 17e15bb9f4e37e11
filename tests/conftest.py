"""Shared fixtures. CPU by default; tests marked ``gpu`` run only where CUDA/ROCm is visible (the H200)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU only under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEFAULT_MODEL = "smollm2-135m-instruct"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU; run on the H200 with `pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine():
    """One fp32 CPU engine for the default model, shared by tests that do not change its config."""
    from configs import EngineConfig
    from flexspec.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, max_model_len=1024, device="cpu"))


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' own implementation of the same weights (the reference for exactness tests)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.executor.model_dir, dtype=torch.float32)
    return model.eval()


def real_prompts(engine, n_each: int = 7) -> list[list[int]]:
    """Token ids of real prompts: GSM8K + MT-Bench via the chat template, HumanEval raw."""
    from flexspec.datasets import load_prompts

    out = []
    for name in ("gsm8k", "humaneval", "mt_bench"):
        for p in load_prompts(name, limit=n_each):
            if p["chat"]:
                out.append(engine.apply_chat_template([{"role": "user", "content": p["prompt"]}]))
            else:
                out.append(engine.encode(p["prompt"]))
    return out


@pytest.fixture(scope="session")
def ray_session():
    """One fresh local 2-CPU Ray cluster per session, shared by tests/actors and tests/cluster.

    ``address="local"``: never attaches to a stale cluster left behind by ``ray stop``. Ray is imported here,
    not at module level, so CPU-only test runs without ``ray`` installed still import this conftest.
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
