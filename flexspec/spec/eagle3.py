"""EAGLE-3 drafter (Li et al., arXiv 2503.01840), method ``eagle3``.

Reads three target layers (low / mid / high, default 2, L/2, L-3) from this step's target forward, fuses them
with ``fc`` into the drafter's hidden input and chains its single decoder layer autoregressively for ``k``
steps: context positions use the target's fused features, later steps the layer's own output (see
:mod:`flexspec.spec.models.feature_chain` for the position convention and the drafter's paged KV cache).
Embedding and LM head are the target's unless the checkpoint ships its own (``embed_tokens``, ``lm_head`` with
a ``d2t`` reduced draft vocabulary). Drafts are greedy.
"""

from __future__ import annotations

import torch

from flexspec.models.loader import resolve_model_dir
from flexspec.spec.models.draft_kv import DraftKVCache
from flexspec.spec.models.eagle3_model import Eagle3DraftModel
from flexspec.spec.models.feature_chain import FeatureChainDrafter
from flexspec.spec.registry import register


@register
class Eagle3Drafter(FeatureChainDrafter):
    method = "eagle3"

    def __init__(self, config, runner) -> None:
        super().__init__(config, runner)
        self.target = runner.model
        self.device = runner.device
        max_tokens = runner.config.max_model_len + self.num_speculative_tokens
        self.net = Eagle3DraftModel.from_pretrained(
            resolve_model_dir(config.model), runner.spec, max_position=max_tokens, device=runner.device,
            dtype=runner.dtype,
        ).eval().requires_grad_(False)  # fmt: skip
        cfg = self.net.config
        layers = sorted(set(cfg.target_layer_ids))
        self._capture = tuple(layers)
        self._feature_index = [layers.index(i) for i in cfg.target_layer_ids]
        self.cache = DraftKVCache(
            num_layers=1,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            block_size=runner.config.kv_block_size,
            max_tokens_per_seq=max_tokens,
            max_num_seqs=runner.config.max_num_seqs,
            dtype=runner.dtype,
            device=runner.device,
        )

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self._capture

    def attention_layers(self) -> list:
        return self.net.attention_layers()

    def features(self, captured: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        return self.net.fuse(
            torch.cat([captured[j].index_select(0, rows) for j in self._feature_index], dim=-1)
        )

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.net.embed_tokens is not None:
            return self.net.embed_tokens(token_ids)
        return self.target.embed_tokens(token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net.compute_logits(hidden, self.target.lm_head)
