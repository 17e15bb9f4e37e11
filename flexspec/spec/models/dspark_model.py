"""DSpark drafter network (arXiv 2607.05147; deepseek-ai/DeepSpec): the DFlash backbone plus two small heads.

* *Markov head* (rank r): ``logits_i += W2 @ W1[prev_i]`` where ``prev_i`` is the draft at position i-1 (the
  anchor for i = 0). It couples the otherwise independent block positions to the token actually drafted before
  them, so it is applied sequentially over the block at inference (teacher-forced with the true previous token
  in training: :meth:`DSparkDraftModel.markov_logits`).
* *Confidence head*: ``c_i = sigmoid(w . h_i + b)`` on the draft hidden state, an estimate that draft i is
  accepted given its predecessors were; drafters stop verifying after the first draft with ``c_i`` below a
  threshold.

Checkpoint = the DFlash layout with ``architectures: ["DSparkDraftModel"]``, ``dspark_config: {markov_rank}``
and tensors ``markov.w1.weight`` [V, r], ``markov.w2.weight`` [V, r], ``confidence.weight`` [1, H],
``confidence.bias`` [1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from flexspec.errors import ModelLoadError
from flexspec.models.spec import ModelSpec
from flexspec.spec.models.checkpoint import config_field
from flexspec.spec.models.dflash_config import DFlashDraftConfig
from flexspec.spec.models.dflash_model import DFlashDraftModel


@dataclass
class DSparkDraftConfig(DFlashDraftConfig):
    markov_rank: int = 256

    ARCHITECTURE: ClassVar[str] = "DSparkDraftModel"

    @classmethod
    def _fields_from(cls, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        fields = super()._fields_from(cfg, source)
        rank = config_field(cfg, "dspark_config.markov_rank", int, source)
        if rank < 1:
            raise ModelLoadError(
                f"{source}: config.json field 'dspark_config.markov_rank' must be >= 1, got {rank}"
            )
        fields["markov_rank"] = rank
        return fields

    def check_target(self, target: ModelSpec, source: str = "config") -> None:
        super().check_target(target, source)
        if self.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"{source}: config.json field 'vocab_size' is {self.vocab_size} but the target's "
                f"vocabulary has {target.vocab_size} tokens (the Markov head is indexed by target token ids)"
            )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["dspark_config"] = {
            **dict(self.extra.get("dspark_config") or {}),
            "markov_rank": self.markov_rank,
        }
        return out


class LowRankMarkov(nn.Module):
    """Bigram logit bias of rank r: ``prev [N] -> W2 @ W1[prev]`` [N, V]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank)  # weight [V, r]
        self.w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r]

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(prev))


class DSparkDraftModel(DFlashDraftModel):
    config_class: ClassVar[type[DFlashDraftConfig]] = DSparkDraftConfig
    config: DSparkDraftConfig

    def __init__(self, config: DSparkDraftConfig, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.markov = LowRankMarkov(config.vocab_size, config.markov_rank)
        self.confidence = nn.Linear(config.hidden_size, 1)
        self.requires_grad_(True)

    def markov_logits(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """[...] previous token ids -> fp32 [..., V] additive logits (training: teacher-forced)."""
        return self.markov(prev_tokens).float()

    def confidence_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] draft hidden states -> [...] acceptance confidence in (0, 1)."""
        return torch.sigmoid(self.confidence(hidden).squeeze(-1).float())

    def select(
        self,
        logits: torch.Tensor,  # [S, K, V] fp32 backbone logits of the first K mask positions
        anchors: torch.Tensor,  # [S] int64 anchor (bonus) token of each block
    ) -> torch.Tensor:  # [S, K] int64 greedy drafts
        """Greedy drafts, the Markov head applied position by position (it reads the previous draft)."""
        prev = anchors
        out = []
        for i in range(logits.shape[1]):
            prev = (logits[:, i] + self.markov_logits(prev)).argmax(-1)  # [S]
            out.append(prev)
        return torch.stack(out, dim=1) if out else anchors.new_zeros(anchors.shape[0], 0)
