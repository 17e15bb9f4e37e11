"""OpenAI request schemas (chat completions, completions) and their mapping to ``SamplingParams``.

Field names and defaults follow OpenAI's API plus vLLM's common extensions (``top_k``, ``stop_token_ids``,
``ignore_eos``). Unknown fields are ignored, as vLLM does, so existing clients keep working; features we do
not implement (tools, penalties, logit bias, echo, ...) are rejected with a 400 naming the field instead of
being silently dropped. Range checks are ``configs.sampling.SamplingParams``'s own.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from configs.sampling import SamplingParams
from flexspec.errors import InvalidRequestError

MAX_CHOICES_PER_REQUEST = 128  # prompts x n of one request: each is an engine sequence


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(_OpenAIModel):
    include_usage: bool = Field(False, description="Send a last chunk with token usage (choices = []).")
    continuous_usage_stats: bool = Field(
        False, description="vLLM extension: with include_usage, every chunk carries the usage so far."
    )


class TextPart(_OpenAIModel):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # required but for assistant messages (OpenAI: null there when the message carried tool calls)
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Content parts other than text (``image_url``, ``input_audio``, ``file``) are named as unsupported
        (the served models read text) instead of failing the text part's schema."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return content

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"content is required for role {role!r}")
        return content

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined; ``developer`` -> ``system``)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class SamplingRequest(_OpenAIModel):
    """Fields shared by chat and text completions."""

    model: str = Field(..., description="Served model name (see /v1/models).")
    n: int = Field(1, ge=1, le=16, description="Choices per prompt.")
    temperature: float | None = Field(None, description="Default 1.0; 0 = greedy.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; -1 = off.")
    max_tokens: int | None = Field(None, description="Output token limit.")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension.")
    ignore_eos: bool = Field(False, description="vLLM extension.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions not implemented: rejected when set (400), not ignored
    min_tokens: int = 0
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_choices(self) -> int:
        """Choices of the response (engine sequences): prompts x n."""
        return self.n

    def _num_logprobs(self) -> int | None:
        return None

    def check_supported(self) -> None:
        """Reject features we do not implement (400 naming the field) rather than ignore them."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported", param=name)
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.min_tokens:
            raise InvalidRequestError("min_tokens is not supported", param="min_tokens")
        if self.include_stop_str_in_output:
            raise InvalidRequestError(
                "include_stop_str_in_output is not supported", param="include_stop_str_in_output"
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )

    def _openai_name(self, field: str) -> str:
        """The request field a ``SamplingParams`` field came from (they differ where OpenAI has aliases)."""
        return field

    def sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """Validated engine parameters for choice ``choice`` (seeded choices get seed + choice so they differ).

        Raises:
            InvalidRequestError: a value out of range; ``param`` names the OpenAI field.
        """
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "seed": None if self.seed is None else self.seed + choice,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": self._num_logprobs(),
        }
        try:
            return SamplingParams(**values)
        except ValidationError as e:
            err = e.errors()[0]
            param = self._openai_name(str(err["loc"][0])) if err.get("loc") else None
            text = f"{param}: {err['msg']}" if param else err["msg"]
            raise InvalidRequestError(text, param=param) from None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(
        None, description="Preferred over max_tokens when both are set."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, description="0-20 alternatives per token; needs logprobs=true.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = Field(
        True, description="vLLM extension: end the prompt with the reply's start."
    )
    continue_final_message: bool = Field(
        False, description="vLLM extension: the reply continues the last (assistant) message, left open."
    )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _openai_name(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "logprobs":
            return "top_logprobs"
        return field

    def _num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                "only response_format type 'text' is supported", param="response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message needs add_generation_prompt set to false",
                    param="continue_final_message",
                )
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError(
                    "continue_final_message needs the last message to be the assistant's",
                    param="continue_final_message",
                )

    def max_output_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The request's limit, or whatever context is left (OpenAI's chat default)."""
        limit = self.requested_max_tokens()
        return limit if limit is not None else max(1, max_model_len - prompt_len)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="Text(s) or token id list(s)."
    )
    logprobs: int | None = Field(None, description="Top-n alternatives per token (0-20).")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        if self.num_choices > MAX_CHOICES_PER_REQUEST:
            raise InvalidRequestError(
                f"{self.num_choices // self.n} prompts x n={self.n} choices exceed {MAX_CHOICES_PER_REQUEST} "
                "per request",
                param="prompt",
            )

    @property
    def num_choices(self) -> int:
        p = self.prompt
        num_prompts = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
        return num_prompts * self.n

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def max_output_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The request's limit, or OpenAI's legacy completions default of 16."""
        limit = self.requested_max_tokens()
        return limit if limit is not None else 16
