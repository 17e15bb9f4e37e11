"""Fixtures for the drafter-training tests: a tiny random Llama target (SmolLM2's tokenizer and chat template,
4 layers of width 64) so that the whole pipeline runs on 2 CPU cores in seconds, and one generated data set.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

# Smoke-run settings shared by the tests (flags of `python -m flexspec.train.run_device`).
TINY_ARGS = [
    "--num-prompts", "4", "--max-new-tokens", "16", "--max-prompt-tokens", "200", "--gen-batch-size", "4",
    "--block-size", "4", "--num-draft-layers", "1", "--batch-size", "2", "--num-anchors", "4",
    "--max-seq-len", "256", "--calibration-hidden-size", "32", "--markov-rank", "8", "--ttt-steps", "3",
    "--val-datasets", "gsm8k:2", "--val-max-new-tokens", "16", "--exact-prompts", "2", "--log-every", "1",
    "--device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF folder of a random 4-layer Llama with the default model's tokenizer. Large init (0.5) makes its
    greedy choices far from ties, so plain and speculative decoding agree despite different kernel shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexspec.models.loader import resolve_model_dir

    src = resolve_model_dir("smollm2-135m-instruct")
    out = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-5,
        initializer_range=0.5,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, out / name)
    return str(out)


@pytest.fixture(scope="session")
def generated(tiny_target: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose generate stage is done (4 prompts x 16 tokens, T=0), made in two resumed runs
    (2 prompts, then 4) to exercise skip-done generation."""
    from flexspec.train.run_device import main

    root = tmp_path_factory.mktemp("generated") / "run"
    base = [
        "--method",
        "dflash",
        "--target",
        tiny_target,
        "--output",
        str(root),
        *TINY_ARGS,
        "--stage",
        "generate",
    ]
    assert main([*base, "--num-prompts", "2"]) == 0
    assert main(base) == 0
    return root


def copy_data(src: Path, dst: Path) -> None:
    """Start a new run folder from generated data (generate then finds every prompt done)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / "data", dst / "data")
