"""Trainer: exact resume after a time-limit stop, LR schedule, every method trains and loads in the engine."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexspec.train.config import TrainConfig
from flexspec.train.progress import Deadline
from tests.train.conftest import TINY_ARGS, copy_data


class StopAfter:
    """A Deadline that expires after ``n`` polls (the trainer polls once per step)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def expired(self, reserve_s: float = 0.0) -> bool:
        self.calls += 1
        return self.calls > self.n


def _cfg(method: str, target: str, root: Path, **kw) -> TrainConfig:
    base = {
        "method": method, "target": target, "output": str(root), "block_size": 4, "num_draft_layers": 1,
        "batch_size": 2, "num_anchors": 4, "max_seq_len": 256, "calibration_hidden_size": 32,
        "markov_rank": 8, "ttt_steps": 3, "device": "cpu", "steps": 4, "save_every": 100, "log_every": 1,
    }  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_resume_after_time_limit_matches_uninterrupted_run(
    tiny_target: str, generated: Path, tmp_path: Path
) -> None:
    from flexspec.train.checkpoint import latest_checkpoint
    from flexspec.train.methods import get_method
    from flexspec.train.trainer import run_train

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for root in (straight, resumed):
        copy_data(generated, root)
    cfg = _cfg("dflash", tiny_target, straight)
    assert run_train(cfg, get_method(cfg), Deadline(None))

    cfg = _cfg("dflash", tiny_target, resumed)
    assert not run_train(cfg, get_method(cfg), StopAfter(2))  # stopped: checkpoint at step 2
    ckpt = latest_checkpoint(resumed)
    assert ckpt is not None and ckpt.name == "step-0000002" and (ckpt / "optimizer.pt").is_file()
    assert run_train(cfg, get_method(cfg), Deadline(None))

    a = load_file(str(latest_checkpoint(straight) / "drafter" / "model.safetensors"))  # type: ignore[operator]
    b = load_file(str(latest_checkpoint(resumed) / "drafter" / "model.safetensors"))  # type: ignore[operator]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    log_a = [json.loads(r)["loss"] for r in (straight / "train_log.jsonl").read_text().splitlines()]
    log_b = [json.loads(r)["loss"] for r in (resumed / "train_log.jsonl").read_text().splitlines()]
    assert log_a == log_b


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    from flexspec.train.trainer import lr_at

    cfg = TrainConfig(
        method="dflash", output="/nonexistent", steps=100, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1
    )
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(x >= y for x, y in itertools.pairwise(lrs[10:]))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


@pytest.mark.parametrize("method", ["dspark", "eagle3"])
def test_other_methods_train_package_and_decode_exactly(
    method: str, tiny_target: str, generated: Path, tmp_path: Path
) -> None:
    from configs import EngineConfig, SamplingParams
    from flexspec.engine.llm_engine import LLMEngine
    from flexspec.train.data import read_rows
    from flexspec.train.run_device import main

    root = tmp_path / method
    copy_data(generated, root)
    args = ["--method", method, "--target", tiny_target, "--output", str(root), *TINY_ARGS, "--steps", "2"]
    for stage in ("train", "package"):
        assert main([*args, "--stage", stage]) == 0
    rows = [json.loads(r) for r in (root / "train_log.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)  # not NaN
    data = [r for r in read_rows(root) if not r.get("skipped")][:2]
    engine = LLMEngine(
        EngineConfig(
            model=tiny_target, device="cpu", max_model_len=256,
            speculative_config={"method": method, "model": str(root / "final"), "num_speculative_tokens": 3},
        )
    )  # fmt: skip
    outs = engine.generate([r["prompt_ids"] for r in data], SamplingParams(max_tokens=16, temperature=0))
    assert [list(o.token_ids) for o in outs] == [r["response_ids"] for r in data]
    assert engine.spec_metrics.num_drafts > 0


def test_cached_features_train_like_online_features(
    tiny_target: str, generated: Path, tmp_path: Path
) -> None:
    from flexspec.train.features import run_extract
    from flexspec.train.methods import get_method
    from flexspec.train.trainer import run_train

    losses = {}
    for cache in (False, True):
        root = tmp_path / f"cache-{cache}"
        copy_data(generated, root)
        cfg = _cfg("dflash", tiny_target, root, steps=2, cache_features=cache)
        assert run_extract(cfg, get_method(cfg), Deadline(None))
        assert (root / "features" / "shard-00000.safetensors").is_file() == cache
        assert run_train(cfg, get_method(cfg), Deadline(None))
        losses[cache] = [json.loads(r)["loss"] for r in (root / "train_log.jsonl").read_text().splitlines()]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_position_metrics_count_leading_correct_drafts() -> None:
    from flexspec.train.methods.base import position_metrics

    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    m = position_metrics(correct, valid)
    torch.testing.assert_close(m["acc_per_pos"], torch.tensor([2 / 3, 2 / 3, 1 / 2]))
    assert float(m["est_mal"]) == pytest.approx(1 + (2 + 1) / 2)  # complete blocks only: rows 0 and 1


def test_init_from_starts_at_the_given_weights_and_refuses_other_shapes(
    tiny_target: str, generated: Path, tmp_path: Path
) -> None:
    from flexspec.train.checkpoint import latest_checkpoint
    from flexspec.train.config import TrainInputError
    from flexspec.train.methods import get_method
    from flexspec.train.target import FrozenTarget
    from flexspec.train.trainer import run_train

    first, second, wrong = tmp_path / "first", tmp_path / "second", tmp_path / "wrong"
    for root in (first, second, wrong):
        copy_data(generated, root)
    cfg = _cfg("dflash", tiny_target, first)
    assert run_train(cfg, get_method(cfg), Deadline(None))
    source = latest_checkpoint(first) / "drafter"  # type: ignore[operator]

    # Stopped before its first step, the continued run saves exactly the weights it started from.
    cfg = _cfg("dflash", tiny_target, second, init_from=str(source))
    assert not run_train(cfg, get_method(cfg), StopAfter(0))
    a = load_file(str(source / "model.safetensors"))
    b = load_file(str(latest_checkpoint(second) / "drafter" / "model.safetensors"))  # type: ignore[operator]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    fresh = _cfg("dflash", tiny_target, tmp_path / "fresh")
    fresh_state = get_method(fresh).build(FrozenTarget(tiny_target, "cpu", max_len=64)).state_dict()
    assert any(not torch.equal(fresh_state[k].float(), a[k].float()) for k in a)  # it did not start fresh

    cfg = _cfg("dflash", tiny_target, wrong, init_from=str(source), num_draft_layers=2)
    with pytest.raises(TrainInputError, match="init-from.*differ"):
        run_train(cfg, get_method(cfg), Deadline(None))
    cfg = _cfg("dflash", tiny_target, wrong, init_from=str(tmp_path / "missing"))
    with pytest.raises(TrainInputError, match="init-from"):
        run_train(cfg, get_method(cfg), Deadline(None))
