"""FlexDraft attention tuning (arXiv 2605.20022): only the tuned q/k/v/o (+ q/k norms) of layers >= split,
the mask embedding and the calibration MLP train; the target (norms, MLPs, embedding, LM head) stays frozen.

The loss itself lives with the model (:meth:`FlexDraftModel.training_loss`: random anchors, mask blocks over
the target's K/V, DFlash's position-decayed CE); it runs its own dense pass of the frozen target, so no
features are extracted or cached for this method."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from flexspec.spec.models.flexdraft_model import FlexDraftModel
from flexspec.train.methods.base import Metrics, TrainMethod

if TYPE_CHECKING:
    from flexspec.models.spec import ModelSpec
    from flexspec.train.target import FrozenTarget


def default_split_layer(num_layers: int) -> int:
    """Tune the last max(2, L // 6) layers (5 of SmolLM2's 30)."""
    return max(1, num_layers - max(2, num_layers // 6))


class FlexDraftMethod(TrainMethod):
    name: ClassVar[str] = "flexdraft"

    def split_layer(self, spec: ModelSpec) -> int:
        return (
            self.cfg.split_layer if self.cfg.split_layer is not None else default_split_layer(spec.num_layers)
        )

    def build(self, target: FrozenTarget) -> nn.Module:
        torch.manual_seed(self.cfg.seed)
        return FlexDraftModel.init_for_target(
            target.model, self.split_layer(target.spec), self.cfg.block_size, self.cfg.calibration_hidden_size
        ).float()

    def load(self, folder: Path, target: FrozenTarget) -> nn.Module:
        return FlexDraftModel.from_pretrained(folder, target.model).to(
            device=target.device, dtype=torch.float32
        )

    def save(self, model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
        assert isinstance(model, FlexDraftModel)
        model.save_pretrained(folder, dtype=dtype)

    def trainable_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        assert isinstance(model, FlexDraftModel)
        return model.trainable_parameters()

    def loss(self, model, batch, target, features, generator) -> tuple[torch.Tensor, Metrics]:
        return model.training_loss(
            target.model,
            batch.input_ids,
            batch.loss_mask,
            self.cfg.num_anchors,
            self.cfg.decay_gamma,
            generator,
        )
