"""Incremental detokenization and stop-string matching.

Fast (Rust) tokenizers decode through ``tokenizers.decoders.DecodeStream`` (a few microseconds a token, as vLLM's
``FastIncrementalDetokenizer``); other tokenizers use vLLM's prefix/read-offset scheme, which calls ``decode``
twice per token (~0.1 ms each through transformers: at batch 64 that was ~2 ms of every decode step on the H200).
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space / merge rules)


class IncrementalDetokenizer:
    """Turns output tokens into text deltas without re-decoding the whole output each step.

    A delta is released only when the decoded text does not end in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._backend = getattr(
            tokenizer, "backend_tokenizer", None
        )  # tokenizers.Tokenizer of a fast tokenizer
        self._stream = (
            DecodeStream(ids=self.ids, skip_special_tokens=True) if self._backend is not None else None
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text it completes (may be empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, searching only where the last ``new_len``
    characters could complete one; None if no stop string occurs."""
    if not stops or new_len == 0:
        return None
    best: int | None = None
    for s in stops:
        start = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best):
            best = i
    return best
