"""DFlash training (Chen et al., arXiv 2602.06036, section 3.3; z-lab/dflash).

Per sequence, ``num_anchors`` random *anchors* a are drawn among response positions whose next token is also
a response token. Each anchor opens a block ``[token a, MASK x (B-1)]`` at positions a .. a+B-1 that sees the
target features of positions < a and its whole block (:func:`train_attention_mask`) — exactly what the drafter
sees at inference when token a is the bonus. Mask position k (1 .. B-1) predicts token a+k with cross-entropy
weight ``exp(-(k-1)/gamma)``: early positions matter most, because a draft counts only if all before it pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.spec.models.checkpoint import save_checkpoint
from flexspec.spec.models.dflash_model import (
    DFlashDraftConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    train_attention_mask,
)
from flexspec.train.data import Batch
from flexspec.train.methods.base import Metrics, TrainMethod, position_metrics

if TYPE_CHECKING:
    from flexspec.models.spec import ModelSpec
    from flexspec.train.target import FrozenTarget


def sample_anchors(
    loss_mask: torch.Tensor,  # [B, T] bool response positions
    num_anchors: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # anchors [B, A] int64, ok [B, A] bool
    """Up to ``num_anchors`` distinct anchors per row, uniformly among positions a with a and a+1 in the
    response. Rows with fewer candidates get ``ok = False`` in the spare columns (their blocks are ignored).
    """
    B, T = loss_mask.shape
    cand = loss_mask.clone()
    cand[:, :-1] &= loss_mask[:, 1:]
    cand[:, -1] = False
    A = min(num_anchors, T)
    scores = torch.rand(B, T, generator=generator, device=loss_mask.device).masked_fill(~cand, -1.0)
    top = scores.topk(A, dim=1)
    return top.indices, top.values >= 0


def decay_weights(num_positions: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[K] CE weight of draft positions k = 1 .. K: exp(-(k-1)/gamma)."""
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / gamma)


@dataclass
class BlockOutputs:
    """Mask-position outputs of all blocks, flattened to the M positions that carry a label."""

    hidden: torch.Tensor  # [M, H] final-norm hidden states
    labels: torch.Tensor  # [M] int64 target token at the position
    prev: torch.Tensor  # [M] int64 token before it (the anchor for k = 1): teacher-forced Markov input
    k: torch.Tensor  # [M] int64 draft position 0 .. K-1 (k = 1 .. B-1 in the paper's numbering)
    valid: torch.Tensor  # [B, A, K] bool: which block positions are the M rows (row-major)


def block_forward(
    model: DFlashDraftModel, batch: Batch, target: FrozenTarget, features: torch.Tensor, num_anchors: int,
    generator: torch.Generator, anchors: torch.Tensor | None = None,
) -> BlockOutputs:  # fmt: skip
    """All blocks of the batch through the drafter; ``anchors`` [B, A] overrides the random draw (tests)."""
    ids, loss_mask = batch.input_ids, batch.loss_mask
    B, T = ids.shape
    Bk = model.block_size
    K = Bk - 1
    if anchors is None:
        anchors, ok = sample_anchors(loss_mask, num_anchors, generator)  # [B, A]
    else:
        ok = torch.ones_like(anchors, dtype=torch.bool)
    A = anchors.shape[1]
    offs = torch.arange(Bk, device=ids.device)
    block_pos = anchors[:, :, None] + offs  # [B, A, Bk]
    block_ids = torch.full_like(block_pos, model.mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    embeds = target.embed(block_ids.view(B, -1))  # [B, A*Bk, H] frozen
    if model.config.input_embedding_scale != 1.0:
        embeds = embeds * model.config.input_embedding_scale
    mask = train_attention_mask(T, anchors, Bk)  # [B, A*Bk, T + A*Bk]
    hidden = model.forward_train(features, embeds, block_pos.view(B, -1), attention_mask=mask)  # [B, A*Bk, H]
    hidden = hidden.view(B, A, Bk, -1)[:, :, 1:]  # [B, A, K, H] mask positions
    label_pos = block_pos[:, :, 1:]  # [B, A, K]
    in_seq = label_pos < T
    lp = label_pos.clamp(max=T - 1).view(B, -1)
    valid = ok[:, :, None] & in_seq & loss_mask.gather(1, lp).view(B, A, K)
    labels = ids.gather(1, lp).view(B, A, K)
    prev = ids.gather(1, (label_pos - 1).clamp(max=T - 1).view(B, -1)).view(B, A, K)
    k = offs[:K].expand(B, A, K)
    return BlockOutputs(hidden[valid], labels[valid], prev[valid], k[valid], valid)


def dflash_loss(
    logits: torch.Tensor,  # [M, V] fp32
    out: BlockOutputs,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:  # loss, correct [M], metrics
    K = out.valid.shape[-1]
    w = decay_weights(K, gamma, logits.device)[out.k]  # [M]
    ce = F.cross_entropy(logits, out.labels, reduction="none")  # [M]
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    correct = logits.detach().argmax(-1) == out.labels  # [M]
    grid = torch.zeros_like(out.valid)
    grid[out.valid] = correct
    return loss, correct, position_metrics(grid.view(-1, K), out.valid.view(-1, K))


class DFlashMethod(TrainMethod):
    name: ClassVar[str] = "dflash"
    model_class: ClassVar[type[DFlashDraftModel]] = DFlashDraftModel

    def draft_config(self, spec: ModelSpec) -> DFlashDraftConfig:
        cfg = self.cfg
        n_feat = cfg.num_target_features or cfg.num_draft_layers
        return self.model_class.config_class.for_target(
            spec,
            num_hidden_layers=cfg.num_draft_layers,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            target_layer_ids=default_target_layer_ids(spec.num_layers, n_feat),
            **self.extra_config(),
        )

    def extra_config(self) -> dict:
        return {}

    def feature_layers(self, spec: ModelSpec) -> list[int]:
        return list(self.draft_config(spec).target_layer_ids)

    def build(self, target: FrozenTarget) -> nn.Module:
        torch.manual_seed(self.cfg.seed)
        model = self.model_class(self.draft_config(target.spec))
        model.reset_parameters()
        return model.to(target.device)

    def load(self, folder: Path, target: FrozenTarget) -> nn.Module:
        model = self.model_class.from_pretrained(
            folder, target.spec, device=target.device, dtype=torch.float32
        )
        return model.requires_grad_(True)

    def save(self, model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
        assert isinstance(model, DFlashDraftModel)
        state = {
            n: t.detach().to(dtype) if t.is_floating_point() else t for n, t in model.state_dict().items()
        }
        save_checkpoint(folder, model.config.to_dict(), state)

    def loss(self, model, batch, target, features, generator) -> tuple[torch.Tensor, Metrics]:
        assert features is not None
        out = block_forward(model, batch, target, features, self.cfg.num_anchors, generator)
        logits = model.compute_logits(out.hidden, target.lm_head)  # [M, V] fp32
        loss, _, metrics = dflash_loss(logits, out, self.cfg.decay_gamma)
        return loss, metrics
