"""What the engine returns per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexspec.engine.sequence import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop strings excluded)
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by this step
    new_text: str = ""  # text added by this step
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # matched stop string or stop token id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
