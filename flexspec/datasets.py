"""Evaluation and training prompt sets shipped with the package (see flexspec/data/README.md for licenses)."""

from __future__ import annotations

import gzip
import json
from importlib.resources import files
from typing import Literal

Dataset = Literal["gsm8k", "gsm8k_train", "math500", "humaneval", "mt_bench", "self_instruct"]

_FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "gsm8k_train": "gsm8k_train.jsonl",
    "math500": "math500_test.jsonl",
    "humaneval": "humaneval.jsonl.gz",
    "mt_bench": "mt_bench_questions.jsonl",
    "self_instruct": "self_instruct_seed_tasks.jsonl",
}


def _rows(name: str) -> list[dict]:
    path = files("flexspec") / "data" / _FILES[name]
    raw = path.read_bytes()
    if _FILES[name].endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def load_prompts(name: Dataset, limit: int | None = None) -> list[dict]:
    """Prompts of a dataset as ``{"prompt": str, "chat": bool}``: chat prompts are user messages; HumanEval
    prompts are raw code completions. MT-Bench uses the first turn."""
    if name not in _FILES:
        raise ValueError(f"unknown dataset {name!r}; choose from {sorted(_FILES)}")
    out = []
    for r in _rows(name):
        if name in ("gsm8k", "gsm8k_train", "math500"):
            out.append({"prompt": r["question"], "chat": True})
        elif name == "humaneval":
            out.append({"prompt": r["prompt"], "chat": False})
        elif name == "mt_bench":
            out.append({"prompt": r["turns"][0], "chat": True})
        else:
            inst = r["instruction"]
            inp = (r.get("instances") or [{}])[0].get("input", "")
            out.append({"prompt": f"{inst}\n\n{inp}".strip(), "chat": True})
        if limit is not None and len(out) >= limit:
            break
    return out
