"""Prompt sources (test sets refused), resumable data shards, batching, stored-config checks, CLI flags."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flexspec.train.config import ConfigMismatchError, TrainConfig, resolve_config
from flexspec.train.data import ShardWriter, batch_indices, read_rows
from flexspec.train.prompts import HeldOutSetError, load_source, plan_prompts


@pytest.mark.parametrize("source", ["gsm8k", "math500", "humaneval", "mt_bench"])
def test_test_sets_are_refused_as_training_prompts(source: str) -> None:
    with pytest.raises(HeldOutSetError, match="test set"):
        load_source(source)


def test_a_copied_test_file_is_refused_too(tmp_path: Path) -> None:
    from importlib.resources import files

    dst = tmp_path / "gsm8k_test.jsonl"
    shutil.copy(str(files("flexspec") / "data" / "gsm8k_test.jsonl"), dst)
    with pytest.raises(HeldOutSetError):
        load_source(str(dst))


def test_run_device_exits_2_on_a_test_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flexspec.train.run_device import main

    assert main(["--method", "dflash", "--output", str(tmp_path / "r"), "--prompts", "math500", "--device", "cpu"]) == 2
    assert "test set" in capsys.readouterr().err


def test_prompt_files_and_stable_plan(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text('{"question": "What is 2+2?"}\n{"instruction": "Sort", "input": "3 1 2"}\n{"turns": ["Hi", "x"]}\n')
    t = tmp_path / "lines.txt"
    t.write_text("first prompt\n\nsecond prompt\n")
    rows = load_source(str(f)) + load_source(str(t))
    assert [r.text for r in rows] == ["What is 2+2?", "Sort\n\n3 1 2", "Hi", "first prompt", "second prompt"]
    a = plan_prompts(["gsm8k_train", str(f)], 10, seed=1)
    assert a == plan_prompts(["gsm8k_train", str(f)], 10, seed=1)
    assert plan_prompts(["gsm8k_train", str(f)], 20, seed=1)[:10] == a  # more prompts extend the same plan


def test_shard_writer_rolls_over_and_drops_a_torn_line(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, shard_size=2)
    w.write([{"id": f"x:{i}"} for i in range(3)])
    shard = tmp_path / "data" / "responses-00001.jsonl"
    shard.write_text(shard.read_text() + '{"id": "x:3", "trunc')  # killed mid-write
    assert [r["id"] for r in read_rows(tmp_path)] == ["x:0", "x:1", "x:2"]
    ShardWriter(tmp_path, shard_size=2).write([{"id": "x:3"}, {"id": "x:4"}])
    assert [r["id"] for r in read_rows(tmp_path)] == [f"x:{i}" for i in range(5)]
    assert len(list((tmp_path / "data").glob("responses-*.jsonl"))) == 3


def test_batches_are_a_function_of_seed_and_step() -> None:
    epoch = [i for s in range(5) for i in batch_indices(10, 2, seed=0, step=s)]
    assert sorted(epoch) == list(range(10))
    assert batch_indices(10, 2, 0, 7) == batch_indices(10, 2, 0, 7)
    assert batch_indices(10, 2, 0, 5) != batch_indices(10, 2, 1, 5)


def test_resumed_run_keeps_stored_settings(tmp_path: Path) -> None:
    root = str(tmp_path / "r")
    resolve_config(TrainConfig(method="dflash", output=root, block_size=8, steps=10))
    again = resolve_config(TrainConfig(method="dflash", output=root, steps=20))  # default block size: stored wins
    assert again.block_size == 8 and again.steps == 20
    with pytest.raises(ConfigMismatchError, match="block-size"):
        resolve_config(TrainConfig(method="dflash", output=root, block_size=4))


def test_typer_and_argparse_fronts_cover_every_field() -> None:
    import inspect

    from flexspec.train.cli import train_drafter
    from flexspec.train.run_device import build_parser

    fields = set(TrainConfig.model_fields)
    assert set(inspect.signature(train_drafter).parameters) == fields
    args = vars(build_parser().parse_args(["--method", "eagle3", "--output", "o", "--prompts", "a", "b",
                                           "--no-cache-features", "--num-prompts", "none", "--lr", "1e-4"]))  # fmt: skip
    cfg = TrainConfig(**args)
    assert (cfg.prompts, cfg.cache_features, cfg.num_prompts, cfg.lr) == (["a", "b"], False, None, 1e-4)


def test_generate_resumed_from_2_to_4_prompts(generated: Path) -> None:
    rows = read_rows(generated)
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    assert all(r["id"].split(":")[0] in ("gsm8k_train", "self_instruct") for r in rows)
    assert all(len(r["response_ids"]) == 16 and r["prompt_ids"] for r in rows)
    meta = json.loads((generated / "data" / "meta.json").read_text())
    assert meta["complete"] and meta["num_done"] == 4 and meta["sampling"]["temperature"] == 0.0
