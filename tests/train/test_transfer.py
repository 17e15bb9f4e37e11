"""export / import of a run folder through size-capped transfers (the H200 device's $OUT limits)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


def _fake_run(root: Path) -> None:
    (root / "data").mkdir(parents=True)
    (root / "data" / "responses-00000.jsonl").write_text('{"id": "a:0"}\n' * 100)
    (root / "final").mkdir()
    (root / "final" / "config.json").write_text("{}")
    (root / "config.json").write_text(json.dumps({"method": "dflash"}))
    (root / "train_log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    ck = root / "checkpoints" / "step-0000005"
    (ck / "drafter").mkdir(parents=True)
    (ck / "state.json").write_text('{"step": 5}')
    save_file({"w": torch.randn(20_000)}, str(ck / "drafter" / "model.safetensors"))  # ~75 kB gzipped
    (ck / "optimizer.pt").write_bytes(os.urandom(300_000))  # incompressible


def test_export_import_round_trip(tmp_path: Path) -> None:
    from flexspec.train.transfer import export, import_bundle

    root, out, back = tmp_path / "run", tmp_path / "out", tmp_path / "back"
    _fake_run(root)
    summary = export(root, out)
    assert summary["bundle"]["dropped"] is None
    assert import_bundle(out, back)
    for p in root.rglob("*"):
        if p.is_file():
            assert (back / p.relative_to(root)).read_bytes() == p.read_bytes(), p
    assert not import_bundle(out, back)  # never overwrites a run


def test_export_drops_optimizer_first_when_over_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexspec.train import transfer

    monkeypatch.setattr(transfer, "PART_BYTES", 60_000)
    monkeypatch.setattr(transfer, "TOTAL_BYTES", 2**20 + 200_000)
    root, out = tmp_path / "run", tmp_path / "out"
    _fake_run(root)
    summary = transfer.export(root, out)
    assert summary["bundle"]["dropped"] == "optimizer"
    files = list(out.iterdir())
    assert len(files) <= transfer.MAX_FILES and all(f.stat().st_size <= 60_000 for f in files)


def test_export_keeps_bf16_checkpoint_weights_when_fp32_do_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flexspec.train import transfer

    monkeypatch.setattr(transfer, "PART_BYTES", 30_000)
    monkeypatch.setattr(transfer, "TOTAL_BYTES", 2**20 + 65_000)
    root, out, back = tmp_path / "run", tmp_path / "out", tmp_path / "back"
    _fake_run(root)
    summary = transfer.export(root, out)
    assert summary["bundle"]["dropped"].startswith("optimizer, fp32")
    transfer.import_bundle(out, back)
    rel = "checkpoints/step-0000005/drafter/model.safetensors"
    w = load_file(str(back / rel))["w"]
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float(), load_file(str(root / rel))["w"], rtol=1e-2, atol=1e-2)
