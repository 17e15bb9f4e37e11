"""The package README (``flexspec/train/package.py``) and the shipped drafters' READMEs state facts: no
machine-local paths, exactness as a property of verification (not a drafter's pass/fail), measured MAL with
where it comes from, numbers equal to the shipped validation.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flexspec.train.config import TrainConfig
from flexspec.train.package import readme

DRAFTERS = Path(__file__).resolve().parents[2] / "flexspec" / "data" / "drafters"
SHIPPED = sorted(DRAFTERS.glob("*/README.md"))
LOCAL_PATH = re.compile(r"(?<![\w.])/(tmp|opt|root|home|work)/")


def _validation(dtype: str | None, mismatches: list[int]) -> dict:
    per = [0.5914, 0.27, 0.0946]
    val = {
        "step": 2200,
        "speculative_config": {"method": "flexdraft", "model": "/tmp/ft/flexdraft/final",
                               "num_speculative_tokens": 15, "execution": "decoupled"},
        "max_new_tokens": 256,
        "temperature": 0.0,
        "datasets": {"gsm8k:100": {"num_prompts": 100, "metrics": {"mean_acceptance_length": 1.9962,
                                                                   "per_position_acceptance": per}}},
        "exact": {"num_prompts": 4, "all_equal": not mismatches, "mismatches": mismatches},
    }  # fmt: skip
    return val | ({"dtype": dtype, "device": "cuda"} if dtype else {})


def _readme(tmp_path, validation: dict) -> str:
    cfg = TrainConfig(
        method="flexdraft",
        output=str(tmp_path / "run"),
        target="/tmp/stage/smol.gguf",
        prompts=["gsm8k_train", "/tmp/data/my_prompts.jsonl"],
        self_prompts=1000,
    )
    recipe = {
        "step": 2200,
        "speculative_config": {"method": "flexdraft", "model": "<this folder>", "num_speculative_tokens": 15},
        "commands": [
            "/opt/torch/.venv/bin/python3 -m flexspec.train.run_device --method flexdraft --output /tmp/ft/flexdraft"
        ],
        "data": {"sampling": {"temperature": 0.0}},
        "validation": validation,
    }
    return readme(cfg, recipe)


def test_no_machine_local_paths(tmp_path):
    text = _readme(tmp_path, _validation("bfloat16", [0, 1, 3]))
    assert not LOCAL_PATH.search(text), text
    assert "# flexdraft drafter for `smol.gguf`" in text and "--model <path to smol.gguf>" in text
    assert "my_prompts.jsonl" in text and "recipe.json" in text


def test_exactness_is_a_property_of_verification(tmp_path):
    text = _readme(tmp_path, _validation("bfloat16", [0, 1, 3]))
    assert "Exact vs plain" not in text and "False" not in text
    assert "Exactness is a property of verification, not of the drafter" in text
    assert "1 of 4 prompts identical" in text and "rounding" in text and "bf16" in text
    assert "identical." in _readme(tmp_path, _validation("bfloat16", [])).split("prompts ")[-1]
    assert "points to a bug" in _readme(tmp_path, _validation("float32", [2]))


def test_says_where_mal_was_measured(tmp_path):
    text = _readme(tmp_path, _validation("bfloat16", []))
    assert "validate stage (flexspec/train/validate.py)" in text and "validation.json" in text
    assert "decoupled execution, 15 draft tokens per step, T=0, up to 256 new tokens per prompt" in text
    assert "bfloat16 on cuda" in text
    assert "| gsm8k:100 | 100 | 2.00 | 0.59, 0.27, 0.09 |" in text


@pytest.mark.parametrize("path", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_shipped_readmes(path):
    text = path.read_text()
    assert not LOCAL_PATH.search(text), LOCAL_PATH.search(text)
    assert "Exact vs plain" not in text and "Exactness is a property of verification" in text
    val = json.loads((path.parent / "validation.json").read_text())
    for name, r in val["datasets"].items():
        m = r["metrics"]
        per = ", ".join(f"{x:.2f}" for x in m["per_position_acceptance"])
        assert f"| {name} | {r['num_prompts']} | {m['mean_acceptance_length']:.2f} | {per} |" in text
    n, bad = val["exact"]["num_prompts"], len(val["exact"]["mismatches"])
    assert f"{n - bad} of {n} prompts identical" in text
    assert f'"model": "{path.parent.name}"' in text  # loads by its built-in id
