"""CPU smoke path of the drafter pipeline (issue 5): generate -> train a few steps -> package -> load the
packaged checkpoint in the real engine -> speculative decoding identical to plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.train.conftest import TINY_ARGS, copy_data


def _run(method: str, target: str, root: Path, *extra: str) -> int:
    from flexspec.train.run_device import main

    return main(["--method", method, "--target", target, "--output", str(root), *TINY_ARGS, *extra])


@pytest.mark.parametrize("method", ["flexdraft", "dflash"])
def test_pipeline_end_to_end(method: str, tiny_target: str, generated: Path, tmp_path: Path) -> None:
    from configs import EngineConfig, SamplingParams
    from flexspec.engine.llm_engine import LLMEngine
    from flexspec.train.data import read_rows

    root = tmp_path / method
    copy_data(generated, root)
    assert _run(method, tiny_target, root, "--steps", "3", "--save-every", "2") == 0

    # Every stage ran and is complete; the log has one row per step.
    status = json.loads((root / "status.json").read_text())
    assert all(status[s]["complete"] for s in ("generate", "extract", "train", "validate", "package"))
    rows = [json.loads(r) for r in (root / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(len(r["acc_per_pos"]) == 3 for r in rows)

    # final/ = what the server loads: config.json + bf16 model.safetensors (+ recipe, README).
    final = root / "final"
    assert {"config.json", "model.safetensors", "recipe.json", "README.md"} <= {
        p.name for p in final.iterdir()
    }
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict == {"torch.bfloat16"}
    recipe = json.loads((final / "recipe.json").read_text())
    assert recipe["step"] == 3 and recipe["data"]["sampling"]["temperature"] == 0.0 and recipe["commands"]

    # The validation stage decoded with the real speculative decoder and checked exactness itself ...
    val = json.loads((root / "validation.json").read_text())
    assert val["exact"]["all_equal"], val
    assert val["datasets"]["gsm8k:2"]["metrics"]["num_drafts"] > 0

    # ... and independently: loading final/ by path reproduces the target's own T=0 responses exactly.
    data = [r for r in read_rows(root) if not r.get("skipped")]
    engine = LLMEngine(
        EngineConfig(
            model=tiny_target, device="cpu", max_model_len=256,
            speculative_config={"method": method, "model": str(final), "num_speculative_tokens": 3},
        )
    )  # fmt: skip
    outs = engine.generate([r["prompt_ids"] for r in data], SamplingParams(max_tokens=16, temperature=0))
    assert [list(o.token_ids) for o in outs] == [r["response_ids"] for r in data]
    assert engine.spec_metrics.num_drafts > 0
