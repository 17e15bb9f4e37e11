"""Training data on disk: ``DIR/data/responses-NNNNN.jsonl`` shards of target responses, and batching.

Row: ``{"id", "prompt", "chat", "prompt_ids", "response_ids", "finish_reason"}`` (+ ``"skipped": reason`` for
prompts that produced no sample). Shards are only appended to, one flushed line per prompt, so a run killed in
the middle loses at most a partial last line, which readers ignore.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def data_dir(root: Path) -> Path:
    return root / "data"


def shard_paths(root: Path) -> list[Path]:
    return sorted(data_dir(root).glob("responses-*.jsonl"))


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a jsonl file; a truncated last line (killed writer) is skipped."""
    if not path.is_file():
        return
    with path.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def read_rows(root: Path) -> list[dict[str, Any]]:
    """All complete rows of all shards, in shard order."""
    return [r for p in shard_paths(root) for r in read_jsonl(p)]


class ShardWriter:
    """Appends rows to the last shard until it holds ``shard_size`` rows, then starts the next one."""

    def __init__(self, root: Path, shard_size: int) -> None:
        self.dir = data_dir(root)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        paths = shard_paths(root)
        self.index = len(paths) - 1 if paths else 0
        self.count = sum(1 for _ in read_jsonl(paths[-1])) if paths else 0
        if paths:
            _drop_partial_line(paths[-1])

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if self.count >= self.shard_size:
                self.index, self.count = self.index + 1, 0
            path = self.dir / f"responses-{self.index:05d}.jsonl"
            with path.open("a") as f:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.count += 1


def _drop_partial_line(path: Path) -> None:
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        path.write_bytes(raw[: raw.rfind(b"\n") + 1])


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


# ---- training samples --------------------------------------------------------------------------------------
@dataclass
class Sample:
    input_ids: list[int]  # prompt + response, cut to max_seq_len
    num_prompt_tokens: int  # tokens before the response (loss positions start here)


def load_samples(root: Path, max_seq_len: int) -> list[Sample]:
    """Training samples in a fixed order (shard order); rows without response tokens are dropped."""
    out = []
    for r in read_rows(root):
        if r.get("skipped") or not r.get("response_ids"):
            continue
        ids = (r["prompt_ids"] + r["response_ids"])[:max_seq_len]
        if len(ids) > len(r["prompt_ids"]) + 1:
            out.append(Sample(ids, len(r["prompt_ids"])))
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with ``pad_id``
    loss_mask: torch.Tensor  # [B, T] bool: response tokens (labels may sit here)
    lengths: torch.Tensor  # [B] int64 real lengths (stays on the CPU: read on the host)
    indices: list[int]  # sample indices (to look up cached features)

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths, self.indices)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def batch_indices(num_samples: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Sample indices of optimizer step ``step`` (0-based): a pure function of (seed, step), so a resumed run
    sees exactly the batches an uninterrupted one would. Epochs are reshuffled; batches never span two."""
    per_epoch = max(1, num_samples // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = epoch_order(num_samples, seed, epoch)
    chunk = order[k * batch_size : (k + 1) * batch_size]
    return chunk if chunk else order[:batch_size]


def collate(samples: list[Sample], indices: list[int], pad_id: int) -> Batch:
    T = max(len(s.input_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        ids[b, :n] = torch.tensor(s.input_ids)
        mask[b, s.num_prompt_tokens : n] = True
        lengths[b] = n
    return Batch(ids, mask, lengths, indices)
