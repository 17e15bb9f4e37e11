"""The interface each drafting method implements to be trained by :mod:`flexspec.train.trainer`.

A method knows how to make a fresh drafter for a target, which target features it reads (if any), its loss on
a batch, and how to write / read its checkpoint folder — the same folder layout the engine loads by path
(``speculative_config = {"method": name, "model": folder}``). Everything else (data, optimizer, schedule,
checkpoints, logging, validation) is shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from flexspec.train.config import TrainConfig
from flexspec.train.data import Batch

if TYPE_CHECKING:
    from flexspec.models.spec import ModelSpec
    from flexspec.train.target import FrozenTarget

Metrics = dict[str, Any]  # "acc_per_pos": tensor [B-1] accuracy per draft position (+ method extras)


class TrainMethod(ABC):
    name: ClassVar[str]

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg

    def feature_layers(self, spec: ModelSpec) -> list[int]:
        """Target layers whose outputs the loss needs as input, in feature order ([] = none: the method runs
        the target itself inside its loss)."""
        return []

    @abstractmethod
    def build(self, target: FrozenTarget) -> nn.Module:
        """A freshly initialised drafter for ``target`` (fp32 parameters on the target's device)."""

    @abstractmethod
    def load(self, folder: Path, target: FrozenTarget) -> nn.Module:
        """A drafter from a checkpoint folder written by :meth:`save` (fp32 parameters, target's device)."""

    @abstractmethod
    def save(self, model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
        """Write ``config.json`` + ``model.safetensors`` in ``dtype`` (the serving layout)."""

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    @abstractmethod
    def loss(
        self,
        model: nn.Module,
        batch: Batch,  # on the training device
        target: FrozenTarget,
        features: torch.Tensor | None,  # [B, T, n*H] target features of ``feature_layers`` (None if [])
        generator: torch.Generator,  # on the training device; the step's only randomness
    ) -> tuple[torch.Tensor, Metrics]:
        """Scalar loss (differentiable w.r.t. the trainable parameters) and metrics (detached)."""

    def speculative_config(self, folder: str) -> dict[str, Any]:
        """The engine's ``speculative_config`` that serves this drafter."""
        return {"method": self.name, "model": folder, "num_speculative_tokens": self.cfg.block_size - 1}


def position_metrics(correct: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Per-position accuracy and an acceptance-length estimate from teacher-forced blocks.

    correct, valid: [N, K] bool, one row per block, column k = draft position k+1. ``est_mal`` = 1 + mean over
    complete blocks (all K positions valid) of the number of leading correct drafts: the MAL the drafter would
    reach at T=0 on this data if its drafts did not depend on earlier drafts.
    """
    with torch.no_grad():
        acc = (correct & valid).float().sum(0) / valid.float().sum(0).clamp(min=1)  # [K]
        full = valid.all(-1)
        lead = (correct & valid).long().cumprod(-1).sum(-1).float()  # [N]
        est = 1.0 + (lead[full].mean() if full.any() else lead.new_zeros(()))
    return {"acc_per_pos": acc, "est_mal": est, "num_labels": valid.sum()}
