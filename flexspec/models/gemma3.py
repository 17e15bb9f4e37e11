"""Gemma 3 text decoder (Gemma Team, arXiv 2503.19786): sandwich norms, (1 + w) RMSNorm, q/k norms,
GeGLU, embeddings scaled by sqrt(hidden), interleaved sliding-window (local RoPE) and global layers."""

from __future__ import annotations

import torch
from torch import nn

from flexspec.distributed import TPGroup
from flexspec.layers.activation import GeluTanhAndMul
from flexspec.layers.attention import AttentionMetadata
from flexspec.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flexspec.layers.norm import RMSNorm
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.features import FeatureCache, store_features
from flexspec.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from flexspec.models.spec import ModelSpec


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, rotary: RotaryEmbedding, sliding: bool) -> None:
        super().__init__()
        scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5
        self.self_attn = LlamaAttention(
            spec,
            tp,
            rotary,
            scale=scale,
            sliding_window=spec.sliding_window if sliding else None,
            norm_offset=True,
        )
        self.mlp = LlamaMLP(spec, tp, act=GeluTanhAndMul())
        eps = spec.rms_norm_eps
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset=True)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    feature_cache: FeatureCache | None = None  # see LlamaForCausalLM.feature_cache

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        max_pos = spec.max_position_embeddings
        global_rope = RotaryEmbedding(spec.head_dim, max_pos, spec.rope_theta, spec.rope_scaling)
        local_rope = RotaryEmbedding(spec.head_dim, max_pos, spec.rope_local_theta or 10000.0)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp)
        self.layers = nn.ModuleList()
        for i in range(spec.num_layers):
            sliding = spec.layer_types[i] == "sliding_attention"
            self.layers.append(Gemma3DecoderLayer(spec, tp, local_rope if sliding else global_rope, sliding))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, offset=True)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, meta)
            if i in capture_layers:
                captured.append(x)
        store_features(self, captured, capture_layers, meta.slot_mapping)
        return self.norm(x), captured

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> logits [N, V]: fp32 (soft-capped in fp32 where the checkpoint caps them), or the LM head's
        own dtype with ``upcast=False`` when no soft cap applies (as ``LlamaModel.compute_logits``)."""
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        if not upcast and not cap:
            return logits
        logits = logits.float()
        return cap * torch.tanh(logits / cap) if cap else logits
