"""Stage (b): target hidden states for the drafter's input.

Default: *online* — the trainer runs the frozen target on each batch (cheap next to the drafter on small
targets, and no disk). With ``cache_features``, they are written once to
``DIR/features/shard-NNNNN.safetensors`` (tensor ``s<i>`` = features of sample i, ``[len_i, n*H]`` in the
target's dtype) and read back by the trainer. Shards are written whole (temp file + rename), so extraction
resumes at the first missing shard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flexspec.train.config import TrainConfig, TrainInputError
from flexspec.train.data import Sample, collate, load_samples, write_json
from flexspec.train.methods.base import TrainMethod
from flexspec.train.progress import Deadline, Progress, log

SAMPLES_PER_SHARD = 256


def features_dir(root: Path) -> Path:
    return root / "features"


def target_spec(cfg: TrainConfig):
    from flexspec.models.loader import load_config, resolve_model_dir
    from flexspec.models.spec import ModelSpec

    return ModelSpec.from_hf(load_config(resolve_model_dir(cfg.target)))


def run_extract(cfg: TrainConfig, method: TrainMethod, deadline: Deadline) -> bool:
    if not cfg.cache_features:
        log.info("extract: online (target features are computed per batch; --cache-features stores them)")
        return True
    layers = method.feature_layers(target_spec(cfg))
    if not layers:
        log.info("extract: %s runs the target inside its loss; nothing to cache", method.name)
        return True
    from flexspec.train.target import FrozenTarget

    root = cfg.dir
    samples = load_samples(root, cfg.max_seq_len)
    if not samples:
        raise TrainInputError(f"no training data in {root / 'data'}: run --stage generate first")
    out = features_dir(root)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "layers": layers, "target": cfg.target, "max_seq_len": cfg.max_seq_len, "num_samples": len(samples),
        "samples_per_shard": SAMPLES_PER_SHARD, "complete": False,
    }  # fmt: skip
    old = out / "meta.json"
    if old.is_file() and {k: v for k, v in json.loads(old.read_text()).items() if k != "complete"} != {
        k: v for k, v in meta.items() if k != "complete"
    }:
        log.warning("extract: cached features were made for other data or layers; rebuilding")
        for p in out.glob("shard-*.safetensors"):
            p.unlink()
    write_json(old, meta)
    num_shards = -(-len(samples) // SAMPLES_PER_SHARD)
    todo = [i for i in range(num_shards) if not (out / f"shard-{i:05d}.safetensors").is_file()]
    if todo:
        target = FrozenTarget(cfg.target, cfg.device, max_len=cfg.max_seq_len)
        pad = target.spec.eos_token_ids[0] if target.spec.eos_token_ids else 0
        with Progress(num_shards, "extract", initial=num_shards - len(todo), unit="shard") as bar:
            for i in todo:
                if deadline.expired():
                    return False
                lo, hi = i * SAMPLES_PER_SHARD, min(len(samples), (i + 1) * SAMPLES_PER_SHARD)
                tensors: dict[str, torch.Tensor] = {}
                for s in range(lo, hi, cfg.batch_size):
                    idx = list(range(s, min(hi, s + cfg.batch_size)))
                    batch = collate([samples[j] for j in idx], idx, pad)
                    feats = target.hidden_states(batch, layers).cpu()  # [B, T, n*H]
                    for b, j in enumerate(idx):
                        tensors[f"s{j}"] = feats[b, : len(samples[j].input_ids)].contiguous()
                path = out / f"shard-{i:05d}.safetensors"
                save_file(tensors, str(path.with_suffix(".tmp")))
                os.replace(path.with_suffix(".tmp"), path)
                bar.update(1)
    meta["complete"] = True
    write_json(old, meta)
    return True


class FeatureCache:
    """Reads cached features back as padded ``[B, T, n*H]`` batches."""

    def __init__(self, root: Path) -> None:
        self.dir = features_dir(root)

    @classmethod
    def open(
        cls, root: Path, layers: list[int], samples: list[Sample], cfg: TrainConfig
    ) -> FeatureCache | None:
        """The cache if it is complete and matches these samples and layers, else None (go online)."""
        path = features_dir(root) / "meta.json"
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        want = {
            "layers": layers,
            "target": cfg.target,
            "max_seq_len": cfg.max_seq_len,
            "num_samples": len(samples),
        }
        if not meta.get("complete") or any(meta.get(k) != v for k, v in want.items()):
            log.warning("train: cached features are incomplete or stale; computing features online")
            return None
        return cls(root)

    def get(self, indices: list[int], T: int, device: torch.device) -> torch.Tensor:
        rows = []
        for i in indices:
            with safe_open(str(self.dir / f"shard-{i // SAMPLES_PER_SHARD:05d}.safetensors"), "pt") as f:
                rows.append(f.get_tensor(f"s{i}"))
        out = rows[0].new_zeros(len(rows), T, rows[0].shape[-1])
        for b, r in enumerate(rows):
            out[b, : r.shape[0]] = r
        return out.to(device, non_blocking=True)
