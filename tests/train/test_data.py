"""Prompt sources (test sets refused), resumable data shards, batching, stored-config checks, CLI flags."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexspec.train.config import ConfigMismatchError, TrainConfig, resolve_config
from flexspec.train.data import ShardWriter, batch_indices, read_rows
from flexspec.train.prompts import HeldOutSetError, load_source, plan_prompts
from tests.train.conftest import TINY_ARGS


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

    assert (
        main(
            ["--method", "dflash", "--output", str(tmp_path / "r"), "--prompts", "math500", "--device", "cpu"]
        )
        == 2
    )
    assert "test set" in capsys.readouterr().err


def test_prompt_files_and_stable_plan(tmp_path: Path) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text(
        '{"question": "What is 2+2?"}\n{"instruction": "Sort", "input": "3 1 2"}\n{"turns": ["Hi", "x"]}\n'
    )
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
    again = resolve_config(TrainConfig(method="dflash", output=root, steps=20))  # block size left out: stored
    assert again.block_size == 8 and again.steps == 20
    assert (
        resolve_config(TrainConfig(method="dflash", output=root)).steps == 20
    )  # omitted: stored, not default
    assert (
        resolve_config(TrainConfig(method="dflash", output=root, block_size=8)).block_size == 8
    )  # same: fine
    with pytest.raises(ConfigMismatchError, match="block-size"):
        resolve_config(TrainConfig(method="dflash", output=root, block_size=4))


def test_typer_and_argparse_fronts_cover_every_field() -> None:
    import inspect

    from flexspec.train.cli import train_drafter
    from flexspec.train.run_device import build_parser

    fields = set(TrainConfig.model_fields)
    assert set(inspect.signature(train_drafter).parameters) == fields
    argv = ["--method", "eagle3", "--output", "o", "--prompts", "a", "b", "--no-cache-features",
            "--num-prompts", "none", "--lr", "1e-4"]  # fmt: skip
    args = vars(build_parser().parse_args(argv))
    cfg = TrainConfig(**args)
    assert (cfg.prompts, cfg.cache_features, cfg.num_prompts, cfg.lr) == (["a", "b"], False, None, 1e-4)


def test_generate_resumed_from_2_to_4_prompts(generated: Path) -> None:
    rows = read_rows(generated)
    assert len(rows) == 4 and len({r["id"] for r in rows}) == 4
    assert all(r["id"].split(":")[0] in ("gsm8k_train", "self_instruct") for r in rows)
    assert all(len(r["response_ids"]) == 16 and r["prompt_ids"] for r in rows)
    meta = json.loads((generated / "data" / "meta.json").read_text())
    assert meta["complete"] and meta["num_done"] == 4 and meta["sampling"]["temperature"] == 0.0


def test_device_entry_point_imports_without_typer_rich_or_gguf(tmp_path: Path) -> None:
    """The H200 has no typer / rich / gguf: the run_device path must not import them."""
    for name in ("typer", "rich", "gguf"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked')")
    repo = Path(__file__).resolve().parents[2]
    code = (
        "import flexspec.train.run_device as r, flexspec.train.pipeline, flexspec.train.transfer\n"
        "from flexspec.train.config import TrainConfig\n"
        "from flexspec.train.methods import get_method\n"
        "for m in ('flexdraft', 'dflash', 'dspark', 'eagle3'):\n"
        "    get_method(TrainConfig(method=m, output='x'))\n"
        "r.build_parser()\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=repo, timeout=120)


def test_typer_command_reports_user_errors(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flexspec.cli import app

    run = CliRunner().invoke
    r = run(
        app, ["train-drafter", "--method", "dflash", "--output", str(tmp_path / "a"), "--prompts", "math500"]
    )
    assert r.exit_code == 2 and "test set" in r.output
    r = run(app, ["train-drafter", "--method", "medusa", "--output", str(tmp_path / "b")])
    assert r.exit_code == 2 and "--method" in r.output


def test_self_generated_prompts_join_the_plan(
    tiny_target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexspec.train import generate
    from flexspec.train.data import read_jsonl
    from flexspec.train.run_device import main

    monkeypatch.setitem(generate.SELF_PROMPT_SAMPLING, "max_tokens", 8)  # the tiny target's replies are noise

    root = tmp_path / "run"
    args = ["--method", "dflash", "--target", tiny_target, "--output", str(root), "--num-prompts", "1",
            "--self-prompts", "2", "--max-new-tokens", "4", "--max-prompt-tokens", "400", "--device", "cpu",
            "--stage", "generate"]  # fmt: skip
    assert main(args) == 0
    selfp = list(read_jsonl(root / "data" / "self_prompts.jsonl"))
    assert [r["id"] for r in selfp] == ["self:0", "self:1"] and all(r["prompt"] for r in selfp)
    ids = {r["id"] for r in read_rows(root)}
    assert {"self:0", "self:1"} <= ids and len(ids) == 3
    assert json.loads((root / "data" / "meta.json").read_text())["num_samples_by_source"]["self"] == 2

    # A run stopped by its time limit after writing the self-prompts but before answering them (seen on the
    # H200): the resumed generate stage must build its engine for those answers alone.
    for shard in (root / "data").glob("responses-*.jsonl"):
        kept = [line for line in shard.read_text().splitlines() if '"self:' not in line.split(",")[0]]
        shard.write_text("".join(line + "\n" for line in kept))
    assert {r["id"] for r in read_rows(root)} == ids - {"self:0", "self:1"}
    assert main(args) == 0
    assert {r["id"] for r in read_rows(root)} == ids


def test_generate_is_independent_of_the_batching(generated: Path, tiny_target: str, tmp_path: Path) -> None:
    """One request running at a time (continuous batching through a call's prompts) writes the same responses
    as the fixture's batches of 4 (fp32: exact)."""
    from flexspec.train.run_device import main

    root = tmp_path / "run"
    args = ["--method", "dflash", "--target", tiny_target, "--output", str(root), *TINY_ARGS,
            "--gen-batch-size", "1", "--stage", "generate"]  # fmt: skip
    assert main(args) == 0
    want = {r["id"]: r["response_ids"] for r in read_rows(generated)}
    assert {r["id"]: r["response_ids"] for r in read_rows(root)} == want
