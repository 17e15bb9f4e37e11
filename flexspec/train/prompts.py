"""Training prompt sources, and the guard that keeps test sets out of training (DESIGN.md section 6).

A source is a shipped dataset name (``gsm8k_train``, ``self_instruct``) or a file: ``.jsonl`` rows with one of
``prompt`` / ``question`` / ``instruction`` (+ optional ``input``) / ``turns`` (first turn), or ``.txt`` with
one prompt per line. Every prompt gets a stable id ``<source>:<row>`` so generation can skip the ones already
done."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from flexspec.datasets import load_prompts
from flexspec.train.config import TrainInputError

TRAIN_DATASETS = ("gsm8k_train", "self_instruct")
TEST_DATASETS = ("gsm8k", "math500", "humaneval", "mt_bench")
# File names of the shipped test splits (a copy of one is refused too).
_TEST_FILES = ("gsm8k_test", "math500_test", "humaneval", "mt_bench_questions")


class HeldOutSetError(TrainInputError):
    """A test split was given as training prompts."""


@dataclass(frozen=True)
class Prompt:
    id: str  # "<source>:<row>"
    text: str
    chat: bool = True  # apply the chat template (False: raw completion prompt)


def load_source(source: str) -> list[Prompt]:
    """All prompts of one source. Raises HeldOutSetError for test splits, ValueError for unknown sources."""
    name = Path(source).name
    stem = name.split(".")[0]
    if source in TEST_DATASETS or stem in _TEST_FILES:
        raise HeldOutSetError(
            f"{source!r} is a test set (gsm8k, math500, humaneval, mt_bench are for evaluation only); "
            f"train on {', '.join(TRAIN_DATASETS)}, your own prompt files, or --self-prompts"
        )
    if source in TRAIN_DATASETS:
        return [Prompt(f"{source}:{i}", p["prompt"], p["chat"]) for i, p in enumerate(load_prompts(source))]  # type: ignore[arg-type]
    path = Path(source)
    if not path.is_file():
        raise TrainInputError(
            f"prompt source {source!r} is neither a training dataset ({', '.join(TRAIN_DATASETS)}) nor a file"
        )
    rows: list[Prompt] = []
    if path.suffix == ".txt":
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                rows.append(Prompt(f"{name}:{i}", line.strip()))
        return rows
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        text = _row_text(r)
        if text is None:
            raise TrainInputError(f"{path}:{i + 1}: row has none of prompt/question/instruction/turns")
        rows.append(Prompt(f"{name}:{i}", text, bool(r.get("chat", True))))
    return rows


def _row_text(r: dict) -> str | None:
    if isinstance(r.get("prompt"), str):
        return r["prompt"]
    if isinstance(r.get("question"), str):
        return r["question"]
    if isinstance(r.get("instruction"), str):
        inp = r.get("input") or (
            (r.get("instances") or [{}])[0].get("input", "") if r.get("instances") else ""
        )
        return f"{r['instruction']}\n\n{inp}".strip()
    if isinstance(r.get("turns"), list) and r["turns"]:
        return str(r["turns"][0])
    return None


def plan_prompts(sources: list[str], num_prompts: int | None, seed: int) -> list[Prompt]:
    """Prompts of all sources, shuffled with ``seed``, the first ``num_prompts`` kept (same on every run)."""
    rows = [p for s in sources for p in load_source(s)]
    random.Random(seed).shuffle(rows)
    return rows[:num_prompts] if num_prompts is not None else rows


# ---- prompts written by the target itself ------------------------------------------------------------------
SELF_PROMPT_INSTRUCTION = (
    "Here is an example of a task a user might ask an AI assistant:\n\n{example}\n\n"
    "Write one new, different task of a similar kind. Reply with the task only."
)


def self_prompt_request(example: str) -> str:
    """The user message that asks the target for a new prompt in the style of ``example``."""
    return SELF_PROMPT_INSTRUCTION.format(example=example.strip()[:1000])


def clean_self_prompt(text: str) -> str | None:
    """Turn the target's reply into a prompt (strip labels like 'Task:'); None if unusable."""
    text = text.strip().strip('"').strip()
    text = re.sub(r"^(new\s+)?(task|question|prompt)\s*[:\-]\s*", "", text, flags=re.IGNORECASE).strip()
    if len(text) < 12 or len(text) > 2000:
        return None
    return text
