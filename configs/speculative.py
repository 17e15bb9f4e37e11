"""``--speculative-config``: vLLM's field names and semantics, one pydantic model per method.

The union is discriminated by ``method``; unknown fields and wrong types fail at load with the field named.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)


class _SpecBase(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    num_speculative_tokens: int = Field(
        5, ge=1, le=64, description="Draft tokens proposed per step (K); MAL is at most K + 1."
    )
    draft_tensor_parallel_size: int | None = Field(
        None, ge=1, description="Drafter TP: 1 or the target's TP (default: the target's)."
    )
    disable_by_batch_size: int | None = Field(
        None, gt=0, description="Turn speculation off when more requests than this are running."
    )
    execution: Literal["auto", "parallel", "decoupled"] = Field(
        "auto",
        description="Per-batch execution: auto (cost model), parallel (draft+verify in one forward; "
        "FlexDraft only) or decoupled (verify, then draft).",
    )
    device_verification: bool = Field(
        True,
        description="Verify and draft in one device-side step, with one host readback per step, where the "
        "drafter supports it (DFlash, FlexDraft decoupled; one TP rank); false = verify on the host, then "
        "draft (the general path, for A/B checks).",
    )
    fused_verification_graphs: bool = Field(
        True,
        description="On GPU, capture a device-side step's tail (acceptance test, drafter context and next "
        "block) as one CUDA graph per (query length, batch size) where the drafter supports it (DFlash); "
        "false = launch it eagerly (A/B checks).",
    )
    draft_lengths: list[StrictInt] | None = Field(
        None,
        min_length=1,
        description="With execution auto: the draft lengths the policy chooses among per batch (each 1 .. "
        "num_speculative_tokens; num_speculative_tokens is always one of them). Default: "
        "num_speculative_tokens and each of 3, 7, 15, 31 that is at most half of it (DFlash's 15: 3, 7, 15), "
        "since a shorter chain verifies fewer tokens per sequence, which wins at large batch sizes. Draft "
        "trees and parallel execution always use num_speculative_tokens.",
    )
    separate_prefill_steps: bool = Field(
        False,
        description="While running requests have draft tokens to verify, prefill arriving prompts in steps "
        "of their own (those requests wait one step) instead of next to the verification queries, so every "
        "verification step stays a pure decode step (device-side verification, decode CUDA graphs); false = "
        "mix them in one step (verified on the device too, outside the decode CUDA graphs).",
    )

    @model_validator(mode="after")
    def _parallel_needs_flexdraft(self) -> _SpecBase:
        method = getattr(self, "method", None)
        if self.execution == "parallel" and method != "flexdraft":
            raise ValueError(f"execution 'parallel' needs method 'flexdraft', not {method!r}")
        return self

    @field_validator("draft_lengths")
    @classmethod
    def _lengths_within_k(cls, lengths: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if lengths is None:
            return None
        k = info.data.get("num_speculative_tokens")  # absent when it failed its own validation
        bad = [n for n in lengths if k is not None and not 1 <= n <= k]
        if bad:
            raise ValueError(f"{bad} must lie within 1 .. num_speculative_tokens ({k})")
        if info.data.get("execution", "auto") != "auto":
            raise ValueError(
                "needs execution 'auto' (a fixed execution always drafts num_speculative_tokens)"
            )
        return lengths

    @model_validator(mode="after")
    def _lengths_for_chains(self) -> _SpecBase:
        if self.draft_lengths is not None and getattr(self, "draft_tree_topk", 1) > 1:
            raise ValueError("draft_lengths applies to chains, not to draft trees (draft_tree_topk > 1)")
        return self

    def policy_draft_lengths(self) -> list[int]:
        """The chain lengths ``execution: auto`` chooses among (``draft_lengths``, see its description),
        ascending, ``num_speculative_tokens`` last."""
        k = self.num_speculative_tokens
        if self.draft_lengths is not None:
            return sorted(set(self.draft_lengths) | {k})
        return [n for n in (3, 7, 15, 31) if 2 * n <= k] + [k]


class NgramConfig(_SpecBase):
    """Prompt lookup decoding: copy the continuation of the latest earlier match of the last n tokens."""

    method: Literal["ngram"] = "ngram"
    prompt_lookup_max: int = Field(4, ge=1, le=32, description="Longest n-gram to match.")
    prompt_lookup_min: int = Field(1, ge=1, le=32, description="Shortest n-gram to match.")

    @model_validator(mode="after")
    def _min_le_max(self) -> NgramConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class DraftModelConfig(_SpecBase):
    """A smaller LM with the target's tokenizer, run autoregressively with its own KV cache."""

    method: Literal["draft_model"] = "draft_model"
    model: str = Field(..., description="Draft model id, HF folder or .gguf file.")


class DFlashConfig(_SpecBase):
    """DFlash block-diffusion drafter (arXiv 2602.06036) fed with target hidden states."""

    method: Literal["dflash"] = "dflash"
    model: str = Field(
        ..., description="Folder of a DFlashDraftModel checkpoint (config.json + safetensors)."
    )
    num_speculative_tokens: int = Field(
        15,
        ge=1,
        le=64,
        description="Drafts per step: a chain of at most block size - 1, or the nodes of a draft tree "
        "(draft_tree_topk > 1; CUDA graphs up to 62 nodes).",
    )
    verification_threshold: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Selective verification: verify drafts while the cumulative product of their drafter "
        "probabilities stays >= this (0 = verify all).",
    )
    draft_tree_topk: int = Field(
        1,
        ge=1,
        le=16,
        description="Draft trees: candidates per depth (1 = a chain of the block's argmax drafts). Above 1, "
        "each step verifies a dynamic tree of num_speculative_tokens nodes (up to 64): the paths of highest "
        "draft-probability product over the block's top candidates (EAGLE-2 style), built and verified on "
        "the device; arriving prompts are then prefilled in steps of their own (as with separate_prefill_steps).",
    )
    defer_context: bool = Field(
        True,
        description="Plain decoding steps leave the drafter's context K/V to be written when the sequence is "
        "next drafted for (the target keeps their hidden states per KV slot, written inside its CUDA graphs), "
        "so a step the policy runs plainly costs what it costs without a drafter; false = write it in every "
        "plain step.",
    )


class DSparkConfig(DFlashConfig):
    """DFlash backbone + low-rank Markov head (arXiv 2607.05147)."""

    method: Literal["dspark"] = "dspark"  # type: ignore[assignment]
    draft_tree_topk: Literal[1] = Field(
        1, description="DSpark drafts chains (its Markov head is sequential)."
    )
    confidence_threshold: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Stop verifying after the first draft whose confidence is below this.",
    )


class Eagle3Config(_SpecBase):
    """EAGLE-3 (arXiv 2503.01840): one autoregressive layer on fused low/mid/high target features."""

    method: Literal["eagle3"] = "eagle3"
    model: str = Field(..., description="Folder of an EAGLE-3 checkpoint.")


class MTPConfig(_SpecBase):
    """The target's own multi-token-prediction layers, applied autoregressively past their depth."""

    method: Literal["mtp"] = "mtp"
    model: str | None = Field(None, description="Checkpoint holding the MTP layers (default: the target's).")
    num_speculative_tokens: int = Field(1, ge=1, le=16, description="Drafts per step.")


class FlexDraftConfig(_SpecBase):
    """FlexDraft (arXiv 2605.20022): attention-tuned last layers co-located with the target."""

    method: Literal["flexdraft"] = "flexdraft"
    model: str = Field(..., description="Folder of a FlexDraft checkpoint (tuned layers + calibration).")
    num_speculative_tokens: int = Field(15, ge=1, le=64, description="Drafts per step (block size - 1).")
    verification_threshold: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Selective verification: keep drafts while cumulative confidence >= this.",
    )


SpeculativeConfig = Annotated[
    NgramConfig | DraftModelConfig | DFlashConfig | DSparkConfig | Eagle3Config | MTPConfig | FlexDraftConfig,
    Field(discriminator="method"),
]

# titled: errors read "1 validation error for speculative_config", not the tagged union's validator chain
_adapter: TypeAdapter = TypeAdapter(SpeculativeConfig, config=ConfigDict(title="speculative_config"))


def parse_speculative_config(data: dict | str) -> SpeculativeConfig:
    """Validate a dict or JSON string; raises pydantic.ValidationError naming the bad field."""
    if isinstance(data, str):
        return _adapter.validate_json(data)
    return _adapter.validate_python(data)
