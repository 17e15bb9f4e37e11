"""DFlash checkpoint configuration (z-lab/dflash ``config.json``): parsing with errors that name the field,
defaults for a given target, and the published layout on save. See :mod:`flexspec.spec.models.dflash_model`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flexspec.errors import ModelLoadError
from flexspec.models.spec import ModelSpec
from flexspec.spec.models.checkpoint import config_field

log = logging.getLogger(__name__)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers to read: spread evenly from layer 1 to L-3 (z-lab's rule; the middle layer for one)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, max(1, num_target_layers - 3)
    ids = [round(start + i * (end - start) / (num_features - 1)) for i in range(num_features)]
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from either transformers 4 or 5 config fields."""
    spec = ModelSpec.from_hf({"vocab_size": 0, "intermediate_size": 0, "num_hidden_layers": 0, **cfg})
    return spec.rope_theta, spec.rope_scaling


@dataclass
class DFlashDraftConfig:
    """The fields of a DFlash ``config.json`` that shape the network (others are kept for the round trip)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int  # B: anchor + B-1 mask tokens
    mask_token_id: int  # a token id of the target's embedding
    target_layer_ids: list[int]  # target layers whose outputs form the context features
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    num_target_layers: int | None = None
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: causal only in sliding layers (z-lab); published B16 models: False
    input_embedding_scale: float = 1.0  # block embeddings = target embedding * this
    output_multiplier: float = 1.0  # logits = lm_head(h) * this
    final_logit_softcapping: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # the original config.json

    ARCHITECTURE: ClassVar[str] = "DFlashDraftModel"

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> DFlashDraftConfig:
        """Validate a ``config.json`` dict. Raises ModelLoadError naming the bad field."""
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or cls.ARCHITECTURE not in archs:
            raise ModelLoadError(
                f"{source}: config.json field 'architectures' must contain {cls.ARCHITECTURE!r}, "
                f"got {archs!r}"
            )
        return cls(**cls._fields_from(cfg, source))

    @classmethod
    def _fields_from(cls, cfg: dict[str, Any], source: str) -> dict[str, Any]:
        def f(path: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            return (
                config_field(cfg, path, kind, source)
                if default is ...
                else config_field(cfg, path, kind, source, default)
            )

        def draft_value(name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            """z-lab reads these from ``dflash_config`` first, then the top level."""
            if isinstance(cfg.get("dflash_config"), dict) and cfg["dflash_config"].get(name) is not None:
                return f(f"dflash_config.{name}", kind)
            if default is ... and cfg.get(name) is None:
                raise ModelLoadError(f"{source}: config.json lacks field 'dflash_config.{name}'")
            return f(name, kind, default)

        hidden = f("hidden_size", int)
        layers = f("num_hidden_layers", int)
        heads = f("num_attention_heads", int)
        kv_heads = f("num_key_value_heads", int, heads)
        sizes = {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ModelLoadError(f"{source}: config.json field {name!r} must be >= 1, got {value}")
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: 'num_attention_heads' {heads} is not a multiple of 'num_key_value_heads'"
            )
        block_size = draft_value("block_size", int)
        if block_size < 2:
            raise ModelLoadError(f"{source}: config.json field 'block_size' must be >= 2, got {block_size}")
        num_target_layers = f("num_target_layers", int, None)
        try:
            ids = draft_value("target_layer_ids", list)
        except ModelLoadError:
            if num_target_layers is None:
                raise
            ids = default_target_layer_ids(num_target_layers, layers)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelLoadError(
                f"{source}: config.json field 'dflash_config.target_layer_ids' must be a non-empty list of "
                f"layer indices, got {ids!r}"
            )
        act = f("hidden_act", str, "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: config.json field 'hidden_act' must be 'silu', got {act!r}")
        layer_types = f("layer_types", list, [])
        if layer_types and len(layer_types) != layers:
            raise ModelLoadError(
                f"{source}: config.json field 'layer_types' has {len(layer_types)} entries for "
                f"{layers} layers"
            )
        try:
            rope_theta, rope_scaling = rope_from_hf(cfg)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: bad rope fields in config.json: {e}") from e
        return {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": f("head_dim", int, hidden // heads),
            "intermediate_size": f("intermediate_size", int),
            "block_size": block_size,
            "mask_token_id": draft_value("mask_token_id", int),
            "target_layer_ids": list(ids),
            "vocab_size": f("vocab_size", int),
            "rms_norm_eps": f("rms_norm_eps", float, 1e-6),
            "rope_theta": rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": f("max_position_embeddings", int, 40960),
            "num_target_layers": num_target_layers,
            "attention_bias": f("attention_bias", bool, False),
            "layer_types": layer_types,
            "sliding_window": f("sliding_window", int, None),
            "is_causal": f("is_causal", bool, None),
            "input_embedding_scale": draft_value("input_embedding_scale", float, 1.0),
            "output_multiplier": draft_value("output_multiplier", float, 1.0),
            "final_logit_softcapping": draft_value("final_logit_softcapping", float, None),
            "extra": dict(cfg),
        }

    @classmethod
    def for_target(
        cls,
        target: ModelSpec,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DFlashDraftConfig:
        """A fresh config sized for ``target`` (its attention geometry, RoPE and vocabulary).

        ``target_layer_ids`` defaults to one per drafter layer spread from 1 to L-3 (z-lab's rule);
        ``mask_token_id`` defaults to the last id of the target's vocabulary (pick a genuinely unused id for
        training).
        """
        fields: dict[str, Any] = {
            "hidden_size": target.hidden_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": target.num_heads,
            "num_key_value_heads": target.num_kv_heads,
            "head_dim": target.head_dim,
            "intermediate_size": target.intermediate_size,
            "block_size": block_size,
            "mask_token_id": target.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": target_layer_ids
            or default_target_layer_ids(target.num_layers, num_hidden_layers),
            "vocab_size": target.vocab_size,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": target.rope_theta,
            "rope_scaling": target.rope_scaling,
            "max_position_embeddings": target.max_position_embeddings,
            "num_target_layers": target.num_layers,
        }
        fields.update(overrides)
        return cls(**fields)

    def check_target(self, target: ModelSpec, source: str = "config") -> None:
        """Raise ModelLoadError (naming the field) when this drafter cannot serve ``target``."""
        if self.hidden_size != target.hidden_size:
            raise ModelLoadError(
                f"{source}: config.json field 'hidden_size' is {self.hidden_size} but the target's hidden "
                f"size is {target.hidden_size} (the drafter shares the target's embedding and LM head)"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ModelLoadError(
                f"{source}: config.json field 'dflash_config.target_layer_ids' has {bad}, outside the "
                f"target's {target.num_layers} layers"
            )
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ModelLoadError(
                f"{source}: config.json field 'dflash_config.mask_token_id' {self.mask_token_id} is not in "
                f"the target's vocabulary (size {target.vocab_size})"
            )
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            log.warning(
                "%s: num_target_layers %d != target layers %d",
                source,
                self.num_target_layers,
                target.num_layers,
            )

    def to_dict(self) -> dict[str, Any]:
        """The published ``config.json`` layout (unknown original fields preserved)."""
        out = {k: v for k, v in self.extra.items() if k != "dflash_config"}
        dflash = {k: v for k, v in dict(self.extra.get("dflash_config") or {}).items() if k != "block_size"}
        dflash.update(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        for name, default in (
            ("input_embedding_scale", 1.0),
            ("output_multiplier", 1.0),
            ("final_logit_softcapping", None),
        ):
            value = getattr(self, name)
            if value != default:
                dflash[name] = value
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        out.update(
            architectures=[self.ARCHITECTURE],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            block_size=self.block_size,
            dflash_config=dflash,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            layer_types=list(self.layer_types) or ["full_attention"] * self.num_hidden_layers,
            sliding_window=self.sliding_window,
            use_sliding_window=any(t == "sliding_attention" for t in self.layer_types),
        )
        out.pop("rope_scaling", None)
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out
