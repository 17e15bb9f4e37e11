"""Side-stream tokens: extra tokens that join a target forward at layer ``start_layer`` with their own
attention weights, sharing the target's norms and MLP (FlexDraft's mask tokens, arXiv 2605.20022).

Side tokens read the target's paged KV cache (their ``meta.slot_mapping`` is all -1: they are never
written) and see each other through ``meta``'s custom mask. At each layer the target tokens run first, so
side tokens also see K/V the target wrote in this very forward (FlexDraft's parallel mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flexspec.layers.attention import AttentionMetadata


@dataclass
class SideStream:
    start_layer: int  # first layer the side tokens pass through
    hidden: torch.Tensor  # [M, H] side tokens' input at start_layer (e.g. a learned mask embedding)
    meta: AttentionMetadata  # side tokens' attention: pseudo-sequences over the target's paged cache
    attn: nn.ModuleList  # one attention module per layer >= start_layer (replaces self_attn for side tokens)
    out: torch.Tensor | None = None  # [M, H] final-normed hidden, filled by the forward
