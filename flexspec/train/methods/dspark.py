"""DSpark training (arXiv 2607.05147; deepseek-ai/DeepSpec): the DFlash loss on the backbone + Markov head,
plus the confidence head.

* Markov head: position k's logits get ``W2 W1[prev]`` with ``prev`` the TRUE token before it (teacher
  forcing; at inference ``prev`` is the previous draft, equal to the true token exactly when that draft was
  accepted, which is the only case where position k is verified at all).
* Confidence head: BCE of ``sigmoid(w . h_k + b)`` against "draft k is correct", on positions whose earlier
  drafts are all correct (the conditional acceptance the drafter thresholds at inference). It reads detached
  hidden states: it calibrates, it does not steer the backbone.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from flexspec.spec.models.dspark_model import DSparkDraftModel
from flexspec.train.methods.base import Metrics
from flexspec.train.methods.dflash import DFlashMethod, block_forward, dflash_loss

CONFIDENCE_LOSS_WEIGHT = 0.1


class DSparkMethod(DFlashMethod):
    name: ClassVar[str] = "dspark"
    model_class = DSparkDraftModel

    def extra_config(self) -> dict:
        return {"markov_rank": self.cfg.markov_rank}

    def build(self, target):
        model = super().build(target)
        with torch.no_grad():
            model.markov.w2.weight.zero_()  # start as plain DFlash: the bias is learnt from zero
        return model

    def loss(self, model, batch, target, features, generator) -> tuple[torch.Tensor, Metrics]:
        assert features is not None
        out = block_forward(model, batch, target, features, self.cfg.num_anchors, generator)
        logits = model.compute_logits(out.hidden, target.lm_head) + model.markov_logits(out.prev)  # [M, V]
        ce_loss, correct, metrics = dflash_loss(logits, out, self.cfg.decay_gamma)
        # Conditional correctness: all earlier positions of the same block correct.
        grid = torch.zeros_like(out.valid)
        grid[out.valid] = correct
        grid = grid | ~out.valid
        earlier_ok = torch.cat([torch.ones_like(grid[..., :1]), grid[..., :-1].long().cumprod(-1).bool()], -1)
        reached = earlier_ok[out.valid]  # [M]
        conf_logit = model.confidence(out.hidden.detach()).squeeze(-1).float()  # [M]
        bce = F.binary_cross_entropy_with_logits(conf_logit, correct.float(), reduction="none")
        conf_loss = (bce * reached).sum() / reached.sum().clamp(min=1)
        metrics["confidence_loss"] = conf_loss.detach()
        metrics["ce_loss"] = ce_loss.detach()
        return ce_loss + CONFIDENCE_LOSS_WEIGHT * conf_loss, metrics
