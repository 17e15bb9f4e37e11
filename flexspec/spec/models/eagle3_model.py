"""EAGLE-3 drafter network (Li et al., arXiv 2503.01840; SafeAILab/EAGLE, vLLM ``llama_eagle3``).

One Llama decoder layer over two inputs per position:
* ``g`` = ``fc(concat(low, mid, high target features))`` [3 * H_t -> H] at context positions, or the layer's
  own previous output (pre-norm) while drafting beyond the context;
* ``e`` = embedding of the next token.

``x = concat(input_layernorm(e), hidden_norm(g))`` [2H] feeds q/k/v; the residual stream starts at ``g``;
``out = MLP block(g + o_proj(attn(x)))``; logits = LM head(``norm(out)``); ``out`` (pre-norm) is fed back.

Checkpoint (EAGLE-3 release layout): ``fc.weight`` [H, 3 H_t], ``midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2H],
``midlayer.self_attn.o_proj .weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``; optional
``lm_head.weight`` [V_d, H] with ``d2t`` [V_d] (draft id + d2t[id] = target id; ``t2d`` is ignored) and
``embed_tokens.weight``; without them the target's LM head / embedding are used. ``config.json``:
``architectures: ["Eagle3DraftModel"]`` (the release's ``LlamaForCausalLMEagle3`` is accepted too),
``eagle_config: {target_layer_ids}`` (vLLM's ``eagle_aux_hidden_state_layer_ids`` accepted), Llama layer
fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from flexspec.errors import ModelLoadError
from flexspec.layers.attention import Attention, AttentionMetadata
from flexspec.layers.norm import RMSNorm
from flexspec.layers.rotary import RotaryEmbedding
from flexspec.models.spec import ModelSpec
from flexspec.spec.models.checkpoint import (
    config_field,
    load_state,
    read_config,
    read_tensors,
    save_checkpoint,
)
from flexspec.spec.models.dflash_config import rope_from_hf
from flexspec.spec.models.dflash_model import DFlashMLP


def default_eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """Low / mid / high target layers as in the EAGLE-3 code: 2, L/2, L-3 (clamped for tiny targets)."""
    L = num_target_layers
    return [min(max(i, 0), L - 1) for i in (2, L // 2, L - 3)]


@dataclass
class Eagle3DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    target_layer_ids: list[int]
    target_hidden_size: int | None = None  # default hidden_size
    draft_vocab_size: int | None = None  # rows of an own lm_head (default vocab_size)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    norm_before_residual: bool = False
    # Decided by the tensors a checkpoint holds (not written to config.json):
    own_lm_head: bool = False
    own_embedding: bool = False
    qk_norm: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    ARCHITECTURE: ClassVar[str] = "Eagle3DraftModel"
    ACCEPTED: ClassVar[tuple[str, ...]] = (
        "Eagle3DraftModel",
        "LlamaForCausalLMEagle3",
        "Eagle3LlamaForCausalLM",
    )

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], source: str = "config", num_target_layers: int | None = None
    ) -> Eagle3DraftConfig:
        """Validate ``config.json``; raises ModelLoadError naming the field. ``target_layer_ids`` may be
        absent when ``num_target_layers`` is known (EAGLE-3's default 2, L/2, L-3 is used)."""
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not any(a in cls.ACCEPTED for a in archs):
            raise ModelLoadError(
                f"{source}: config.json field 'architectures' must contain one of {list(cls.ACCEPTED)}, "
                f"got {archs!r}"
            )

        def f(path: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            return (
                config_field(cfg, path, kind, source)
                if default is ...
                else config_field(cfg, path, kind, source, default)
            )

        layers = f("num_hidden_layers", int, 1)
        if layers != 1:
            raise ModelLoadError(
                f"{source}: config.json field 'num_hidden_layers' must be 1 for EAGLE-3, got {layers}"
            )
        hidden = f("hidden_size", int)
        heads = f("num_attention_heads", int)
        kv_heads = f("num_key_value_heads", int, heads)
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise ModelLoadError(
                f"{source}: 'num_attention_heads' {heads} / 'num_key_value_heads' {kv_heads} invalid"
            )
        ids = f("eagle_config.target_layer_ids", list, None)
        if ids is None:
            ids = f("eagle_config.eagle_aux_hidden_state_layer_ids", list, None)
        if ids is None:
            if num_target_layers is None:
                raise ModelLoadError(f"{source}: config.json lacks field 'eagle_config.target_layer_ids'")
            ids = default_eagle3_layer_ids(num_target_layers)
        if len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelLoadError(
                f"{source}: config.json field 'eagle_config.target_layer_ids' must list 3 layer indices, "
                f"got {ids!r}"
            )
        if f("hidden_act", str, "silu") != "silu":
            raise ModelLoadError(f"{source}: config.json field 'hidden_act' must be 'silu'")
        try:
            rope_theta, rope_scaling = rope_from_hf(cfg)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: bad rope fields in config.json: {e}") from e
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=f("head_dim", int, hidden // heads),
            intermediate_size=f("intermediate_size", int),
            vocab_size=f("vocab_size", int),
            target_layer_ids=list(ids),
            target_hidden_size=f("target_hidden_size", int, None),
            draft_vocab_size=f("draft_vocab_size", int, None),
            rms_norm_eps=f("rms_norm_eps", float, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=f("max_position_embeddings", int, 8192),
            attention_bias=f("attention_bias", bool, False),
            norm_before_residual=f("norm_before_residual", bool, False),
            extra=dict(cfg),
        )

    @classmethod
    def for_target(
        cls, target: ModelSpec, target_layer_ids: list[int] | None = None, **overrides: Any
    ) -> Eagle3DraftConfig:
        """A fresh config with the target's attention geometry, RoPE and vocabulary."""
        fields: dict[str, Any] = {
            "hidden_size": target.hidden_size,
            "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "intermediate_size": target.intermediate_size,
            "vocab_size": target.vocab_size,
            "target_layer_ids": target_layer_ids or default_eagle3_layer_ids(target.num_layers),
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta,
            "rope_scaling": target.rope_scaling,
            "max_position_embeddings": target.max_position_embeddings,
        }
        fields.update(overrides)
        return cls(**fields)

    def check_target(self, target: ModelSpec, source: str = "config") -> None:
        """Raise ModelLoadError (naming the field) when this drafter cannot serve ``target``."""
        if (self.target_hidden_size or self.hidden_size) != target.hidden_size:
            raise ModelLoadError(
                f"{source}: config.json field 'target_hidden_size' (default 'hidden_size') is "
                f"{self.target_hidden_size or self.hidden_size}, the target's hidden size is "
                f"{target.hidden_size}"
            )
        if not self.own_embedding and self.hidden_size != target.hidden_size:
            raise ModelLoadError(
                f"{source}: config.json field 'hidden_size' {self.hidden_size} != target hidden size "
                f"{target.hidden_size} and the checkpoint has no embed_tokens of its own"
            )
        if self.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"{source}: config.json field 'vocab_size' is {self.vocab_size}, the target's is "
                f"{target.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ModelLoadError(
                f"{source}: config.json field 'eagle_config.target_layer_ids' has {bad}, outside the "
                f"target's {target.num_layers} layers"
            )

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        eagle = {
            k: v
            for k, v in dict(self.extra.get("eagle_config") or {}).items()
            if k != "eagle_aux_hidden_state_layer_ids"
        }
        eagle["target_layer_ids"] = list(self.target_layer_ids)
        out.pop("rope_scaling", None)
        out.update(
            architectures=[self.ARCHITECTURE],
            model_type="llama",
            hidden_size=self.hidden_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters={
                "rope_type": "default",
                **(self.rope_scaling or {}),
                "rope_theta": self.rope_theta,
            },
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            norm_before_residual=self.norm_before_residual,
            tie_word_embeddings=False,
            eagle_config=eagle,
        )
        for name in ("target_hidden_size", "draft_vocab_size"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class Eagle3Attention(nn.Module):
    """Causal attention whose q/k/v read the 2H-wide [embedding; hidden] input."""

    def __init__(self, cfg: Eagle3DraftConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, D, D**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T, 2H] -> [T, H]
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(meta.positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).reshape(T, -1))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg.hidden_size, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embeds, hidden [T, H] -> pre-norm output [T, H]."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3DraftModel(nn.Module):
    config_class: ClassVar[type[Eagle3DraftConfig]] = Eagle3DraftConfig

    def __init__(self, config: Eagle3DraftConfig, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.rotary = RotaryEmbedding(
            config.head_dim,
            max_position or config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.fc = nn.Linear(len(config.target_layer_ids) * (config.target_hidden_size or H), H, bias=False)
        self.midlayer = Eagle3Layer(config, self.rotary)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = (
            nn.Linear(H, config.draft_vocab_size or config.vocab_size, bias=False)
            if config.own_lm_head
            else None
        )
        if config.own_lm_head and config.draft_vocab_size not in (None, config.vocab_size):
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.embed_tokens = nn.Embedding(config.vocab_size, H) if config.own_embedding else None
        self.requires_grad_(True)

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        self.rotary.cos, self.rotary.sin = self.rotary.cos.float(), self.rotary.sin.float()  # RoPE stays fp32
        if self.d2t is not None:
            self.d2t = self.d2t.long()
        return self

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[N, 3 * H_t] low/mid/high target features -> [N, H]."""
        return self.fc(target_features)

    def forward(
        self, token_embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_embeds, hidden [T, H] -> (final-norm hidden for logits, pre-norm hidden fed back)."""
        out = self.midlayer(token_embeds, hidden, meta)
        return self.norm(out), out

    def compute_logits(
        self, hidden: torch.Tensor, target_lm_head: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """[N, H] -> fp32 [N, V] over the target vocabulary (draft-vocab logits scattered through ``d2t``)."""
        if self.lm_head is None:
            return target_lm_head(hidden).float()
        logits = self.lm_head(hidden).float()  # [N, V_d]
        if self.d2t is None:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, torch.arange(logits.shape[1], device=logits.device) + self.d2t] = logits
        return full

    def save_pretrained(self, folder: str | Path) -> None:
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
    ) -> Eagle3DraftModel:
        """Load a checkpoint folder (``layers.0.*`` names are read as ``midlayer.*``).

        Raises:
            ModelLoadError: naming the bad config field or the missing / unexpected / mis-shaped tensor.
        """
        folder = Path(folder)
        source = str(folder)
        config = cls.config_class.from_dict(
            read_config(folder), source, target_spec.num_layers if target_spec is not None else None
        )
        tensors = {_canonical(n): t for n, t in read_tensors(folder).items()}
        config.own_lm_head = "lm_head.weight" in tensors
        config.own_embedding = "embed_tokens.weight" in tensors
        config.qk_norm = "midlayer.self_attn.q_norm.weight" in tensors
        if config.own_lm_head and config.draft_vocab_size is None:
            config.draft_vocab_size = tensors["lm_head.weight"].shape[0]
        if target_spec is not None:
            config.check_target(target_spec, source)
        model = cls(config, max_position=max_position)
        load_state(model, tensors, source, ignore=frozenset({"t2d"}))
        return model.to(device=device, dtype=dtype)


def _canonical(name: str) -> str:
    for prefix in ("model.layers.0.", "layers.0."):
        if name.startswith(prefix):
            return "midlayer." + name[len(prefix) :]
    return name.removeprefix("model.")
