"""DSpark drafter (arXiv 2607.05147; deepseek-ai/DeepSpec), method ``dspark``.

The DFlash drafting loop (context cache, one non-causal block per sequence) with two changes in how the
block's outputs become drafts (:mod:`flexspec.spec.models.dspark_model`):
* drafts are chosen position by position with the low-rank Markov bias of the previous draft (the anchor for
  the first), so position i sees what was actually drafted at i-1;
* the confidence head cuts the proposal: verification stops after the first draft whose confidence is below
  ``confidence_threshold`` (that draft is still proposed; 0 keeps every draft).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from flexspec.spec.base import SeqDraftInput
from flexspec.spec.dflash import DFlashDrafter
from flexspec.spec.models.dflash_model import DFlashDraftModel
from flexspec.spec.models.dspark_model import DSparkDraftModel
from flexspec.spec.registry import register


def verification_length(confidence: list[float], threshold: float) -> int:
    """Drafts to verify: through the first one whose confidence is below ``threshold`` (all if none is)."""
    for i, c in enumerate(confidence):
        if c < threshold:
            return i + 1
    return len(confidence)


@register
class DSparkDrafter(DFlashDrafter):
    method = "dspark"
    model_class: ClassVar[type[DFlashDraftModel]] = DSparkDraftModel
    model: DSparkDraftModel
    greedy_drafts: ClassVar[bool] = False  # Markov-biased selection: the block forward stays eager

    def _select(
        self, items: list[SeqDraftInput], hidden: torch.Tensor, logits: torch.Tensor
    ) -> list[list[int]]:
        anchors = torch.tensor([b.token_ids[-1] for b in items], device=self.device)
        tokens = self.model.select(logits, anchors).tolist()  # [S][K]
        threshold = self.config.confidence_threshold
        confidence = self.model.confidence_scores(hidden).tolist() if threshold > 0 else None  # [S][K]
        out = []
        for s, b in enumerate(items):
            k = min(b.num_drafts, self.num_speculative_tokens)
            if confidence is not None:
                k = verification_length(confidence[s][:k], threshold)
            out.append(tokens[s][:k])
        return out
