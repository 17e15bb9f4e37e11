"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS


class SamplingParams(BaseModel):
    """How to pick output tokens for one request.

    Semantics follow vLLM's ``SamplingParams``: ``temperature == 0`` is greedy (argmax); otherwise logits are
    divided by ``temperature``, then ``top_k`` and ``top_p`` truncate the distribution before sampling. As in
    vLLM, a temperature below ``GREEDY_BELOW`` (1e-5) is greedy: dividing float32 logits by it overflows to
    inf, and the softmax of that is NaN.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, gt=0, description="Maximum number of output tokens.")
    temperature: float = Field(
        1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 = greedy; >0 scales logits."
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass, in (0, 1]."
    )
    top_k: int = Field(
        -1,
        ge=-1,
        le=2**31 - 1,
        description="Keep the k most likely tokens; -1 or 0 = all (at most 2^31 - 1).",
    )
    seed: int | None = Field(None, description="Per-request RNG seed (reproducible sampling).")
    stop: list[str] = Field(default_factory=list, max_length=64, description="Stop strings (not returned).")
    stop_token_ids: list[int] = Field(
        default_factory=list, max_length=256, description="Extra stop token ids."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return the chosen token's logprob and top-n."
    )

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, v: float) -> float:
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > 256:
                raise ValueError("stop strings must be at most 256 characters")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
