"""DFlash drafter network (Chen et al., arXiv 2602.06036; z-lab/dflash ``DFlashDraftModel``).

Terms:
* *target features*: the target's hidden states (residual stream after layer ``i``) at ``target_layer_ids``,
  concatenated per position: ``[T, n * H]``.
* *context*: ``hidden_norm(fc(target features))``, one row per committed position ``[T, H]``. Every drafter
  layer projects it with its OWN ``k_proj``/``v_proj`` (+ ``k_norm``, RoPE at the row's position) into that
  layer's context K/V; nothing else of the context passes through the layers, so the context K/V of a position
  is computed once and cached.
* *block*: ``[anchor, MASK x (B-1)]`` at positions ``L-1 .. L+B-2``, where the anchor is the last committed
  token (the bonus; it has no target hidden state yet). Block tokens enter as the target's (frozen) input
  embeddings, attend non-causally to each other and to all context, and go through Qwen3-style layers; the B-1
  mask positions' outputs, through ``norm`` and the target's LM head, are the drafts.

Checkpoint format (z-lab): ``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``dflash_config: {mask_token_id, target_layer_ids}`` and Qwen3 layer fields; tensors ``fc.weight`` [H, n*H],
``hidden_norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
``layers.{i}.{input,post_attention}_layernorm.weight``, ``norm.weight``. No embedding and no LM head: the
target's are used.

Two forwards share every weight: ``forward`` (inference: varlen batch of blocks over a paged context cache)
and ``forward_train`` (dense, differentiable: batch of sequences with any number of blocks and an explicit
mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.layers.norm import RMSNorm
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.spec import ModelSpec
from flexspec.spec.models.checkpoint import (
    load_state,
    read_config,
    read_tensors,
    save_checkpoint,
)
from flexspec.spec.models.dflash_config import DFlashDraftConfig, default_target_layer_ids, rope_from_hf
from flexspec_kernels import store_kv_cache

__all__ = [
    "DFlashDraftConfig",
    "DFlashDraftModel",
    "default_target_layer_ids",
    "rope_from_hf",
    "train_attention_mask",
]


class DFlashMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm before RoPE) whose keys/values are the context's plus the block's own."""

    def __init__(self, cfg: DFlashDraftConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.rotary = rotary
        layer_type = cfg.layer_types[layer_idx] if cfg.layer_types else "full_attention"
        self.sliding_window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.causal = layer_type == "sliding_attention" if cfg.is_causal is None else cfg.is_causal
        self.scale = D**-0.5
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, D, self.scale, sliding_window=self.sliding_window
        )

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [N, H] at positions [N] -> this layer's context K, V [N, Hkv, D] (K normed and rotated)."""
        N = ctx.shape[0]
        k = self.k_norm(self.k_proj(ctx).view(N, self.num_kv_heads, self.head_dim))
        v = self.v_proj(ctx).view(N, self.num_kv_heads, self.head_dim)
        _, k = self.rotary(positions, k, k)
        return k, v

    def block_qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Hq, D], k, v [T, Hkv, D] (normed, rotated)."""
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Paged: x [T, H] block tokens; cached context via ``meta``; ``meta.mask`` = within-block."""
        T = x.shape[0]
        q, k, v = self.block_qkv(x, meta.positions)
        if self.causal:
            meta = dataclasses.replace(meta, mask=None, mask_start_loc=None)
        o = self.attn(q, k, v, meta)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, -1))

    def forward_dense(
        self,
        x: torch.Tensor,  # [B, Q, H] block tokens (after input_layernorm)
        ctx: torch.Tensor,  # [B, T, H] projected context
        q_pos: torch.Tensor,  # [B, Q] int64
        ctx_pos: torch.Tensor,  # [B, T] int64
        visible: torch.Tensor,  # [B, Q, T + Q] bool
    ) -> torch.Tensor:  # [B, Q, H]
        B, Q, H = x.shape
        T = ctx.shape[1]
        q, kb, vb = self.block_qkv(x.reshape(B * Q, H), q_pos.reshape(-1))
        kc, vc = self.context_kv(ctx.reshape(B * T, H), ctx_pos.reshape(-1))
        keys = torch.cat([kc.view(B, T, -1, self.head_dim), kb.view(B, Q, -1, self.head_dim)], dim=1)
        values = torch.cat([vc.view(B, T, -1, self.head_dim), vb.view(B, Q, -1, self.head_dim)], dim=1)
        k_pos = torch.cat([ctx_pos, q_pos], dim=1)  # [B, T + Q]
        if self.causal:
            visible = visible & (k_pos[:, None, :] <= q_pos[:, :, None])
        if self.sliding_window is not None:
            visible = visible & (q_pos[:, :, None] - k_pos[:, None, :] < self.sliding_window)
        group = self.num_heads // self.num_kv_heads
        q = q.view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)  # [B, Hq, Q, D]
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, T + Q, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None], scale=self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx, rotary)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x, ctx, q_pos, ctx_pos, visible) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), ctx, q_pos, ctx_pos, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The DFlash drafter network. Parameters are trainable after construction; drafters freeze them.

    Args:
        config: network shape and DFlash fields (see :class:`DFlashDraftConfig`).
        max_position: size of the RoPE table (default ``config.max_position_embeddings``); inference sizes
            it to ``max_model_len + block_size``.
    """

    config_class: ClassVar[type[DFlashDraftConfig]] = DFlashDraftConfig

    def __init__(self, config: DFlashDraftConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max_position or config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.requires_grad_(True)

    # ---- properties ---------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def attention_layers(self) -> list[Attention]:
        """Attention cores whose ``k_cache``/``v_cache`` hold the context K/V (bind a paged cache to them)."""
        return [layer.self_attn.attn for layer in self.layers]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.rotary.cos, self.rotary.sin = self.rotary.cos.float(), self.rotary.sin.float()  # RoPE stays fp32
        return self

    def reset_parameters(self, std: float = 0.02) -> None:
        """Training init: linear weights ~ N(0, std), biases 0, norms 1."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.normal_(0.0, std)
                    if m.bias is not None:
                        m.bias.zero_()
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)

    # ---- context ------------------------------------------------------------------------------------------
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., n * H] concatenated target features -> [..., H] context rows."""
        return self.hidden_norm(self.fc(target_features))

    def store_context(
        self, target_features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Cache every layer's context K/V of new committed positions (inference; caches bound beforehand).

        target_features [N, n * H]; positions [N] int64; slot_mapping [N] int64 (slots in the bound caches).
        """
        ctx = self.project_context(target_features)  # [N, H]
        for layer in self.layers:
            attn = layer.self_attn
            k, v = attn.context_kv(ctx, positions)  # [N, Hkv, D]
            store_kv_cache(k.contiguous(), v.contiguous(), attn.attn.k_cache, attn.attn.v_cache, slot_mapping)

    # ---- forwards -----------------------------------------------------------------------------------------
    def forward(self, block_embeds: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Inference over the paged context cache.

        block_embeds [T, H]: the blocks of S sequences, packed (``meta.query_start_loc``);
        ``meta.context_lens`` = cached context length per sequence; ``meta.slot_mapping`` all -1 (block K/V
        are never cached); ``meta.mask`` = within-block visibility (all True for DFlash).
        Returns final-norm hidden [T, H].
        """
        x = block_embeds
        for layer in self.layers:
            x = layer(x, meta)
        return self.norm(x)

    def forward_train(
        self,
        target_features: torch.Tensor,  # [B, T, n * H] target hidden states at target_layer_ids, concatenated
        block_embeds: torch.Tensor,  # [B, Q, H] target input embeddings of the block tokens (anchor / MASK)
        block_positions: torch.Tensor,  # [B, Q] int64 absolute positions of the block tokens
        context_positions: torch.Tensor | None = None,  # [B, T] int64; default 0 .. T-1
        attention_mask: torch.Tensor | None = None,  # [B, Q, T + Q] bool, True = query may attend key
    ) -> torch.Tensor:  # [B, Q, H] final-norm hidden states (logits: compute_logits)
        """Dense, differentiable forward for training (same weights and math as ``forward``).

        Keys are the T context positions followed by the Q block tokens. ``attention_mask`` defaults to "every
        query sees everything" (one block after the whole context); for several blocks per sequence pass
        :func:`train_attention_mask` (block sees context before its anchor + its own block). Every query must
        see at least one key (its own block).
        """
        B, T, _ = target_features.shape
        Q = block_embeds.shape[1]
        if context_positions is None:
            context_positions = torch.arange(T, device=block_embeds.device).expand(B, T)
        if attention_mask is None:
            attention_mask = torch.ones(B, Q, T + Q, dtype=torch.bool, device=block_embeds.device)
        ctx = self.project_context(target_features)  # [B, T, H]
        x = block_embeds
        for layer in self.layers:
            x = layer.forward_dense(x, ctx, block_positions, context_positions, attention_mask)
        return self.norm(x)

    def compute_logits(
        self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor], upcast: bool = True
    ) -> torch.Tensor:
        """[N, H] -> fp32 [N, V] with the target's LM head (+ the checkpoint's multiplier / soft cap).
        ``upcast=False``: the LM head's own dtype where neither applies (for a consumer that upcasts itself)."""
        logits = lm_head(hidden)
        if not upcast and self.config.output_multiplier == 1.0 and not self.config.final_logit_softcapping:
            return logits
        logits = logits.float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the published layout."""
        save_checkpoint(Path(folder), self.config.to_dict(), self.state_dict())

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        target_spec: ModelSpec | None = None,
        *,
        max_position: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DFlashDraftModel:
        """Load a checkpoint folder; with ``target_spec``, also check it fits that target.

        Raises:
            ModelLoadError: missing / malformed config field, missing / unexpected / mis-shaped tensor,
                corrupt file, or a drafter that does not fit the target; the message names the field or
                tensor.
        """
        folder = Path(folder)
        source = str(folder)
        config = cls.config_class.from_dict(read_config(folder), source)
        if target_spec is not None:
            config.check_target(target_spec, source)
        model = cls(config, max_position=max_position)
        load_state(model, read_tensors(folder), source)
        return model.to(device=device, dtype=dtype)


def train_attention_mask(
    context_len: int,  # T
    anchors: torch.Tensor,  # [B, nb] int64 anchor position of each block (context positions are 0 .. T-1)
    block_size: int,
) -> torch.Tensor:  # [B, nb * block_size, T + nb * block_size] bool
    """DFlash training visibility: block j sees context positions < its anchor and all of its own block."""
    B, nb = anchors.shape
    device = anchors.device
    Q = nb * block_size
    block_of_query = torch.arange(Q, device=device) // block_size  # [Q]
    ctx = (
        torch.arange(context_len, device=device)[None, None, :]
        < anchors.repeat_interleave(block_size, 1)[:, :, None]
    )
    own = (block_of_query[:, None] == block_of_query[None, :]).expand(B, Q, Q)
    return torch.cat([ctx, own], dim=-1)
