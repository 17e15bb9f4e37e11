"""Vocab-parallel embedding and LM head (vocabulary split over TP ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.distributed import TPGroup, shard_range
from flexspec.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start, vocab_end) live on this rank; lookups all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = shard_range(vocab_size, tp.rank, tp.size)
        self.shard_sizes = [e - s for s, e in (shard_range(vocab_size, r, tp.size) for r in range(tp.size))]
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        shard = loaded[self.vocab_start : self.vocab_end]
        if shard.shape != param.shape:
            raise ValueError(
                f"embedding: checkpoint shard {tuple(shard.shape)}, expected {tuple(param.shape)}"
            )
        param.data.copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.weight.shape[0])
        y = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its vocab slice, then all-gathers."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V]
        logits = linear(hidden, self.weight)
        return self.tp.all_gather_last_dim(logits, self.shard_sizes)
