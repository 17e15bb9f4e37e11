"""Normalized view of an HF ``config.json`` (only what our model files need)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention" per layer
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def context_problem(self, max_model_len: int) -> str | None:
        """Why ``max_model_len`` tokens do not fit this model's positions; None when they do."""
        if max_model_len > self.max_position_embeddings:
            return (
                f"{max_model_len} exceeds the model's max_position_embeddings {self.max_position_embeddings}"
            )
        return None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelSpec:
        if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrapper (Gemma 3 4B+)
            cfg = {**cfg["text_config"], "architectures": cfg.get("architectures", [])}
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM"}.get(model_type, model_type)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rope_local = cfg.get("rope_local_base_freq")
        if (
            isinstance(rope, dict) and "full_attention" in rope
        ):  # per-layer-type rope (transformers 5, Gemma 3)
            rope_local = rope.get("sliding_attention", {}).get("rope_theta", rope_local)
            rope = rope["full_attention"]
        if isinstance(rope, dict):
            rope_theta = rope.get("rope_theta", rope_theta)
            if rope.get("rope_type", "default") == "default" and "factor" not in rope:
                rope = None
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        num_layers = cfg["num_hidden_layers"]
        layer_types = list(cfg.get("layer_types") or [])
        if model_type.startswith("gemma3") and not layer_types:
            pattern = cfg.get("sliding_window_pattern", 6)
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
            ]
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3", "gemma3_text"),
            hidden_act=cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window"),
            layer_types=layer_types,
            rope_local_theta=float(rope_local) if rope_local else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            raw=cfg,
        )
