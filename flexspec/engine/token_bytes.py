"""The raw bytes of one token, and its name in OpenAI logprobs.

A token may hold only part of a UTF-8 character (an emoji split over byte-level BPE tokens, a SentencePiece
byte-fallback token ``<0xF0>``); ``tokenizer.decode([id])`` turns such a part into U+FFFD and loses its
bytes. The bytes come from the token's vocabulary piece instead:

- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): each character of the piece stands for one byte through
  GPT-2's byte <-> unicode table (``Ġ`` = 0x20);
- SentencePiece-style BPE (Llama 2, Gemma): ``<0xHH>`` is the byte 0xHH, ``▁`` is a space, the rest is text;
- added / special tokens (``<|im_end|>``): their content as UTF-8;
- any other tokenizer: ``decode([id])`` as UTF-8 (lossy only for partial characters).

Names follow OpenAI: the text when the bytes are valid UTF-8, else ``bytes:`` and the bytes escaped
(``bytes:\\xf0\\x9f``; printable ASCII other than the backslash kept as is), as OpenAI's own API names
partial-character tokens.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Literal

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"  # ▁, SentencePiece's space

PieceKind = Literal["byte_level", "sentencepiece", "decode"]


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's table from the printable unicode character that stands for a byte back to that byte
    (the inverse of transformers' ``bytes_to_unicode``)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_name(raw: bytes) -> str:
    """OpenAI's name of a token with bytes ``raw``: its text, or ``bytes:\\xNN...`` if not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


class TokenBytes:
    """Raw bytes and OpenAI names of a tokenizer's tokens, cached per token id.

    Args:
        tokenizer: a transformers tokenizer (fast or slow).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = piece_kind(tokenizer)
        self._added = {
            int(i): str(getattr(t, "content", t))
            for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._cache[token_id] = self._compute(token_id)
        return raw

    def name(self, token_id: int) -> str:
        return token_name(self.bytes_of(token_id))

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.kind != "decode" else None
        if isinstance(piece, str):
            if self.kind == "byte_level":
                table = gpt2_byte_decoder()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            else:  # sentencepiece
                if m := _BYTE_PIECE.fullmatch(piece):
                    return bytes([int(m.group(1), 16)])
                return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")
        return self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode("utf-8")


def piece_kind(tokenizer: Any) -> PieceKind:
    """How the tokenizer's vocabulary pieces encode bytes, read from its decoder (fast tokenizers) or its
    attributes (slow ones)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        decoder = backend.decoder  # its JSON, not the whole tokenizer's (seconds for a 262k vocabulary)
        types = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
        if "ByteLevel" in types:
            return "byte_level"
        if "ByteFallback" in types or "Metaspace" in types:
            return "sentencepiece"
        return "decode"
    if getattr(tokenizer, "byte_decoder", None) is not None:  # slow GPT-2 style
        return "byte_level"
    if getattr(tokenizer, "sp_model", None) is not None:  # slow SentencePiece
        return "sentencepiece"
    return "decode"


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    types = {decoder.get("type", "")}
    for d in decoder.get("decoders", []) or []:
        types |= _decoder_types(d)
    return types
