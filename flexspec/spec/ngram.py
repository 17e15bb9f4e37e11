"""N-gram (prompt lookup) drafter (Saxena 2023, "Prompt Lookup Decoding"; vLLM ``method: ngram``).

Finds the most recent earlier occurrence of the last n committed tokens, for the longest n in
[prompt_lookup_min, prompt_lookup_max] that matches, and proposes the tokens that followed it. No weights;
drafts are deterministic.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from flexspec.spec.base import Drafter, DraftProposal, SeqDraftInput
from flexspec.spec.registry import register


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Drafts (at most k) continuing the latest earlier match of the longest suffix n-gram of ``tokens``."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        windows = sliding_window_view(tokens[: L - 1], n)  # starts 0 .. L-1-n; excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@register
class NgramDrafter(Drafter):
    method = "ngram"
    observes_every_step = False

    def propose(self, batch: list[SeqDraftInput], captured: list[torch.Tensor]) -> DraftProposal:
        cfg = self.config
        out = []
        for item in batch:
            if item.num_drafts == 0:
                out.append([])
                continue
            arr = np.asarray(item.token_ids, dtype=np.int64)
            out.append(ngram_propose(arr, cfg.prompt_lookup_min, cfg.prompt_lookup_max, item.num_drafts))
        return DraftProposal(token_ids=out)
