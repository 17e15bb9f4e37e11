"""The frozen target for training: our own model implementation (the exact weights and math the engine
serves), run as a dense causal forward over packed sequences, with no KV cache.

``hidden_states`` returns the residual stream after chosen layers — the same tensors the engine's
``capture_layers`` hands to drafters at inference — padded to ``[B, T, H]``.
"""

from __future__ import annotations

import torch

from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.train.data import Batch


class FrozenTarget:
    """Target weights on ``device`` (bf16 on GPU, fp32 on CPU), ``requires_grad=False``.

    Attention layers get a one-block dummy KV cache: every slot in ``slot_mapping`` is -1 (nothing is written)
    and every context length is 0 (nothing is read), so attention is causal over each packed sequence.
    """

    def __init__(self, model: str, device: str = "auto", max_len: int = 2048) -> None:
        from configs import EngineConfig
        from flexspec.engine.model_runner import ModelRunner
        from flexspec.models.loader import load_config, resolve_model_dir
        from flexspec.models.spec import ModelSpec

        spec = ModelSpec.from_hf(load_config(resolve_model_dir(model)))
        self.max_len = min(max_len, spec.max_position_embeddings)
        self.runner = ModelRunner(EngineConfig(model=model, device=device, max_model_len=self.max_len))
        self.model = self.runner.model.requires_grad_(False)
        self.spec = self.runner.spec
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        self.model_dir = self.runner.model_dir
        for a in self.model.modules():
            if isinstance(a, Attention) and not a.k_cache.numel():
                shape = (1, 16, a.num_kv_heads, a.head_dim)
                a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
                a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_ids)

    @property
    def lm_head(self):
        return self.model.lm_head

    @torch.no_grad()
    def hidden_states(self, batch: Batch, layers: list[int]) -> torch.Tensor:
        """Target features ``[B, T, len(layers) * H]`` (layer outputs concatenated in ``layers`` order; zero
        rows on padding), in the target's dtype."""
        lengths = batch.lengths.tolist()
        B, T = batch.input_ids.shape
        dev = self.device
        flat = torch.cat([batch.input_ids[b, :n] for b, n in enumerate(lengths)]).to(dev)  # [N]
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)  # [N]
        qsl = torch.tensor([0] + lengths).cumsum(0).to(dev, torch.int32)  # [B+1]
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=torch.full_like(positions, -1),
            block_tables=torch.zeros(B, 1, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(B, dtype=torch.int32, device=dev),
            query_start_loc=qsl,
            max_query_len=max(lengths),
        )
        unique = sorted(set(layers))
        _, captured = self.model(flat, meta, capture_layers=tuple(unique))  # [N, H] each
        feats = torch.cat([captured[unique.index(i)] for i in layers], dim=-1)  # [N, n*H]
        out = feats.new_zeros(B, T, feats.shape[-1])
        row = torch.arange(T, device=dev)[None, :] < batch.lengths.to(dev)[:, None]  # [B, T]
        out[row] = feats
        return out
