"""Attention over the paged KV cache, with the per-step metadata passed explicitly.

Each step packs the new tokens of all scheduled sequences into one flat batch of T tokens. Their K/V are
written to the cache by ``slot_mapping`` (slot < 0: not cached, e.g. FlexDraft mask tokens) and attention
reads the cached context of each sequence through its block table plus the step's own new tokens, under a
causal mask or a custom per-sequence mask (speculative verification / drafting groups).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from flexspec_kernels import paged_attention, paged_attention_triton, store_kv_cache
from flexspec_kernels.attention_split import SplitKVPartials


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    Shapes: S sequences, T new tokens in the step.
    """

    positions: torch.Tensor  # [T] int64 absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64 KV-cache slot per new token; -1 = do not cache
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32 tokens already cached before this step
    query_start_loc: torch.Tensor  # [S+1] int32
    max_query_len: int  # max new tokens of one sequence (host int, keeps launches sync-free)
    mask: torch.Tensor | None = None  # packed bool [sum n_s^2]; None = causal over new tokens
    mask_start_loc: torch.Tensor | None = None  # [S+1] int64
    logits_indices: torch.Tensor | None = None  # [N] rows of the hidden states that need logits
    # Tensors a backend derives from this metadata once for all layers (the CPU attention path's gather
    # indices and mask); build a new AttentionMetadata whenever the metadata's values change.
    step_cache: dict = field(default_factory=dict)


class Attention(nn.Module):
    """Multi-head attention core (after projections): store K/V, attend over cache + new tokens."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, Hkv, D], bound by the model runner
        self.v_cache = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_stored: bool = False,
        merge: bool = True,
    ) -> torch.Tensor | SplitKVPartials:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. ``kv_stored``: the caller already wrote k/v to the cache
        (fused with RoPE). ``merge=False``: on the Triton path a split-KV launch returns its partial softmax
        states unmerged (:class:`~flexspec_kernels.attention_split.SplitKVPartials`) for a consumer that merges them
        (``flexspec_kernels.skinny_merge.skinny_merge_linear``); other paths return the output as usual."""
        if self.k_cache.numel() and not kv_stored:
            store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if not merge and q.is_cuda:
            return paged_attention_triton(
                q, k, v, self.k_cache, self.v_cache,
                meta.block_tables, meta.context_lens, meta.query_start_loc, meta.positions,
                scale=self.scale, sliding_window=self.sliding_window,
                mask=meta.mask, mask_start_loc=meta.mask_start_loc,
                logits_soft_cap=self.logits_soft_cap, max_query_len=meta.max_query_len, merge=False,
            )  # fmt: skip
        return paged_attention(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_start_loc,
            meta.positions,
            scale=self.scale,
            sliding_window=self.sliding_window,
            mask=meta.mask,
            mask_start_loc=meta.mask_start_loc,
            logits_soft_cap=self.logits_soft_cap,
            max_query_len=meta.max_query_len,
            step_cache=meta.step_cache,
            slot_mapping=meta.slot_mapping if self.k_cache.numel() else None,
        )
