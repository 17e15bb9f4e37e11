"""Training checkpoints: ``DIR/checkpoints/step-NNNNNNN/``.

* ``drafter/`` — the method's checkpoint folder in fp32 (same layout the engine loads; :mod:`package` casts
  it)
* ``optimizer.pt`` — AdamW state (tensors and numbers only; read back with ``weights_only=True``)
* ``state.json`` — step, learning rate, method; the LR schedule and the data order are functions of the step
* ``rng.safetensors`` — torch CPU (+ CUDA) RNG states

A checkpoint is written under ``.tmp`` and renamed into place, so a run killed mid-write leaves the previous
one. The latest ``keep`` checkpoints are kept. ``optimizer.pt`` may be missing in an exported (size-capped)
state: the run then resumes the weights with fresh optimizer moments and says so."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flexspec.train.methods.base import TrainMethod
from flexspec.train.progress import log


def checkpoints_dir(root: Path) -> Path:
    return root / "checkpoints"


def list_checkpoints(root: Path) -> list[Path]:
    d = checkpoints_dir(root)
    return sorted(
        p
        for p in d.glob("step-*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / "state.json").is_file()
    )


def latest_checkpoint(root: Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def checkpoint_step(ckpt: Path) -> int:
    return int(json.loads((ckpt / "state.json").read_text())["step"])


def save_training_checkpoint(
    root: Path,
    method: TrainMethod,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    final = checkpoints_dir(root) / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    method.save(model, tmp / "drafter", torch.float32)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(
        json.dumps({"step": step, "method": method.name, **extra}, indent=2) + "\n"
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def restore_training_state(ckpt: Path, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Load optimizer + RNG state of ``ckpt`` (weights are loaded by the method); returns the step."""
    state = json.loads((ckpt / "state.json").read_text())
    opt_path = ckpt / "optimizer.pt"
    if opt_path.is_file():
        optimizer.load_state_dict(torch.load(opt_path, map_location=device, weights_only=True))
    else:
        log.warning("%s has no optimizer.pt (size-capped export): resuming with fresh AdamW moments", ckpt)
    rng_path = ckpt / "rng.safetensors"
    if rng_path.is_file():
        rng = load_file(str(rng_path))
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return int(state["step"])
