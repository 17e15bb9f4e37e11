"""Stage (c): train the drafter.

AdamW (betas 0.9/0.95) over the method's trainable parameters (fp32 master weights), linear warm-up then
cosine decay to ``min_lr_ratio * lr``, bf16 autocast on GPU (fp32 on CPU), gradient-norm clipping. Everything
random in a step (batch, anchors) is a function of ``(seed, step)``, so a run resumed from a checkpoint takes
exactly the steps an uninterrupted run would. Every ``log_every`` steps a row goes to ``DIR/train_log.jsonl``
(loss, lr, grad norm, per-position accuracy, acceptance-length estimates, throughput); ``DIR/loss_curve.png``
is redrawn at every checkpoint."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from flexspec.train.checkpoint import latest_checkpoint, restore_training_state, save_training_checkpoint
from flexspec.train.config import TrainConfig, TrainInputError
from flexspec.train.data import batch_indices, collate, load_samples
from flexspec.train.features import FeatureCache
from flexspec.train.methods.base import TrainMethod
from flexspec.train.plot import plot_loss_curve
from flexspec.train.progress import Deadline, Progress, log

SAVE_RESERVE_S = 20.0  # stop this long before the deadline so the last checkpoint fits


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine to the floor."""
    warm = cfg.warmup_steps
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) & 0x7FFFFFFFFFFF


class _Meter:
    """Sums metrics on the device between log rows (one host sync per row)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.n = 0

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) and k != "num_labels":
                v = v.detach().float()
                self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()
        self.n += 1

    def pop(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self.sums.items():
            mean = (v / max(self.n, 1)).cpu()
            out[k] = [round(x, 5) for x in mean.tolist()] if mean.dim() else round(mean.item(), 5)
        self.sums, self.n = {}, 0
        return out


def run_train(cfg: TrainConfig, method: TrainMethod, deadline: Deadline) -> bool:
    """Train up to ``cfg.steps``. Returns False when stopped by the time limit (a checkpoint was written)."""
    from flexspec.train.target import FrozenTarget

    root = cfg.dir
    ckpt = latest_checkpoint(root)
    if ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] >= cfg.steps:
        log.info("train: %s already reached step %d", ckpt.name, cfg.steps)
        return True
    samples = load_samples(root, cfg.max_seq_len)
    if not samples:
        raise TrainInputError(f"no training data in {root / 'data'}: run --stage generate first")
    target = FrozenTarget(cfg.target, cfg.device, max_len=cfg.max_seq_len + cfg.block_size + cfg.ttt_steps)
    dev = target.device
    if ckpt is not None:
        model = method.load(ckpt / "drafter", target)
    elif cfg.init_from is not None:
        model = _init_from(cfg.init_from, method, target)
    else:
        model = method.build(target)
    params = method.trainable_parameters(model)
    num_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step = restore_training_state(ckpt, opt, dev) if ckpt is not None else 0
    layers = method.feature_layers(target.spec)
    cache = FeatureCache.open(root, layers, samples, cfg) if layers and cfg.cache_features else None
    pad_id = target.spec.eos_token_ids[0] if target.spec.eos_token_ids else 0
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
    )
    log.info("train: %s, %d trainable parameters, %d samples, step %d -> %d on %s",
             method.name, num_params, len(samples), step, cfg.steps, dev)  # fmt: skip
    model.train()
    meter = _Meter()
    t_log, tokens = time.perf_counter(), 0
    log_path = root / "train_log.jsonl"
    last_loss = float("nan")
    with Progress(cfg.steps, "train", initial=step, unit="step") as bar:
        while step < cfg.steps:
            if deadline.expired(SAVE_RESERVE_S):
                break
            idx = batch_indices(len(samples), cfg.batch_size, cfg.seed, step)
            batch = collate([samples[i] for i in idx], idx, pad_id).to(dev)
            tokens += sum(len(samples[i].input_ids) for i in idx)
            generator = torch.Generator(device=dev).manual_seed(step_seed(cfg.seed, step))
            lr = lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            feats = None
            if layers:
                T = batch.input_ids.shape[1]
                feats = cache.get(idx, T, dev) if cache is not None else target.hidden_states(batch, layers)
            with autocast:
                loss, metrics = method.loss(model, batch, target, feats, generator)
            opt.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step += 1
            meter.add({"loss": loss, "grad_norm": gnorm, **metrics})
            if step % cfg.log_every == 0 or step == cfg.steps:
                row = _log_row(meter.pop(), step, lr, tokens, time.perf_counter() - t_log)
                last_loss = row["loss"]
                t_log, tokens = time.perf_counter(), 0
                with log_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.update(0, loss=f"{last_loss:.4f}", mal=row.get("acc_cumprod_mal"))
            bar.update(1)
            if step % cfg.save_every == 0 or step == cfg.steps:
                _save(cfg, method, model, opt, step, last_loss)
    if step < cfg.steps:
        _save(cfg, method, model, opt, step, last_loss)
        log.info(
            "train: time limit at step %d of %d (checkpoint written; run again to continue)", step, cfg.steps
        )
        return False
    return True


def _init_from(source: str, method: TrainMethod, target) -> torch.nn.Module:
    """The drafter at ``source`` (built-in id or folder) as a starting point, checked against the shape this
    run's settings build (a different method, layer count or block size would train something else).

    Raises:
        TrainInputError: unknown id / missing folder, or parameter names or shapes differ from this run's.
    """
    from flexspec.errors import FlexspecError
    from flexspec.models.loader import resolve_model_dir

    try:
        folder = resolve_model_dir(source)
    except FlexspecError as e:
        raise TrainInputError(f"--init-from: {e.message}") from None
    fresh = {n: tuple(t.shape) for n, t in method.build(target).state_dict().items()}
    try:
        model = method.load(folder, target)
    except FlexspecError as e:
        raise TrainInputError(
            f"--init-from {source}: not a {method.name} drafter for this target: {e.message}"
        ) from None
    block_size = getattr(getattr(model, "config", None), "block_size", None)
    if block_size is not None and block_size != method.cfg.block_size:
        raise TrainInputError(
            f"--init-from {source}: block size {block_size}, this run's --block-size is {method.cfg.block_size}"
        )
    got = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if got != fresh:
        diff = sorted(set(got.items()) ^ set(fresh.items()))[:4]
        raise TrainInputError(
            f"--init-from {source}: its parameters differ from the drafter this run builds "
            f"(--method {method.name}, --block-size, --num-draft-layers, ... ); first differences: {diff}"
        )
    log.info("train: starting from the weights of %s (%s)", source, folder)
    return model


def _log_row(means: dict[str, Any], step: int, lr: float, tokens: int, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "lr": lr, **means}
    acc = means.get("acc_per_pos")
    if isinstance(acc, list):
        cum, run = 1.0, 1.0
        for a in acc:
            run *= a
            cum += run
        row["acc_cumprod_mal"] = round(cum, 4)  # 1 + sum_k prod_{j<=k} acc_j
    row["tokens_per_s"] = round(tokens / max(seconds, 1e-9), 1)
    row["time"] = round(time.time(), 1)
    return row


def _save(cfg: TrainConfig, method: TrainMethod, model, opt, step: int, loss: float) -> Path:
    path = save_training_checkpoint(
        cfg.dir,
        method,
        model,
        opt,
        step,
        {"lr": lr_at(cfg, max(step - 1, 0)), "loss": loss},
        cfg.keep_checkpoints,
    )
    plot_loss_curve(cfg.dir)
    return path
