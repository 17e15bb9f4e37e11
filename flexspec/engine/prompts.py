"""Prompts from OpenAI-style messages (the model's chat template) and text (the tokenizer): the engine's side of
turning a request into token ids (part of :class:`~flexspec.engine.llm_engine.LLMEngine`)."""

from __future__ import annotations

from typing import Any

from flexspec.errors import InvalidRequestError


class PromptMixin:
    """Chat templating and tokenization for ``LLMEngine``."""

    # provided by LLMEngine
    config: Any
    tokenizer: Any

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render OpenAI-style messages with the model's chat template; returns prompt token ids."""
        return self.encode(self.render_chat_template(messages), add_special_tokens=False)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text of OpenAI-style messages (chat template), untokenized; its token ids are
        ``encode(text, add_special_tokens=False)``. ``add_generation_prompt``: end with the start of the
        assistant's reply; ``continue_final_message``: leave the last message open (no end-of-turn) so the
        reply continues it (transformers' ``apply_chat_template`` options of the same names, as vLLM's).

        Raises:
            InvalidRequestError: no messages, or the model has no chat template.
        """
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {self.config.model!r} has no chat template", param="messages")
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt`` (with the tokenizer's BOS etc. unless ``add_special_tokens`` is False)."""
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
