"""A sound lower bound on a text's token count from its length, so an oversized prompt is rejected before the
tokenizer spends seconds on it (a 5 MB prompt took ~8 s to tokenize only to be refused).

``L_max`` is the largest number of characters of the input text that one token can stand for. When every
character is covered by at least one token, a text of ``C`` characters has at least ``ceil(C / L_max)`` tokens.
Characters a tokenizer may drop (no token at all) are not counted: byte-level BPE drops a byte whose symbol is
missing from its vocabulary (SmolLM2 has no symbol for 6 ASCII control bytes: ``"\x04" * 10`` is 0 tokens).
:func:`prompt_length_bound` builds the bound only for tokenizers whose definition (``tokenizer.json``) shows
that it holds, else returns None and no early check is made:

- normalizer: none, ``Prepend``, or ``Replace`` of a plain string by one at least as long (NFC / NFKC,
  lowercasing, stripping, charsmaps can shorten the text);
- pre-tokenizer: none or ``ByteLevel`` / ``Metaspace`` / ``Digits`` / ``Split`` / ``Punctuation`` that keep every
  character (not ``behavior: removed``; ``Whitespace`` drops spaces);
- model: BPE (its initial symbols are single characters or bytes) in which every character becomes some
  token: byte fallback with all 256 ``<0xHH>`` pieces, or an unknown token that is not fused over runs of
  unknown characters; or byte-level BPE with the symbols of all UTF-8 continuation bytes (0x80-0xBF, so every
  non-ASCII character keeps one), the ASCII characters whose byte symbol is missing being the ones dropped;
  BPE without any of these drops unknown characters;
- no added token that strips whitespace around it (``lstrip`` / ``rstrip`` can swallow any number of spaces).

(A truncation setting of the backend does not matter: transformers turns it off for ``encode`` without
``truncation=True``.)

A token's piece has at least as many characters as the input characters it covers: a byte-level piece has one
character per byte (an input character is >= 1 byte), a Metaspace piece one per normalized character (``▁`` for
a space), a byte-fallback piece ``<0xHH>`` covers at most one, an unknown token one, an added token its content.
So ``L_max`` = the longest piece of the vocabulary (model vocabulary and added tokens).

``flexspec.errors.check_prompt_min_tokens`` turns the bound into the server's 400.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


@dataclass(frozen=True)
class PromptLengthBound:
    """What one tokenizer can do to a text's length: ``max_chars_per_token`` (L_max, >= 1) input characters at
    most per token, and the ``dropped`` characters, which may produce no token at all."""

    max_chars_per_token: int
    dropped: frozenset[str] = frozenset()

    def min_num_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can have: ``ceil((len(text) - dropped characters) / L_max)``."""
        counted = len(text) - sum(text.count(c) for c in self.dropped)
        return -(-counted // self.max_chars_per_token)


def prompt_length_bound(tokenizer: Any) -> PromptLengthBound | None:
    """The bound of a transformers tokenizer (module docstring), or None when none is known to hold.

    Args:
        tokenizer: a transformers tokenizer; only fast ones (with ``backend_tokenizer``) get a bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a backend that cannot describe itself: no bound
        log.debug("tokenizer has no JSON form; no prompt-length bound", exc_info=True)
        return None
    if not _keeps_length(spec.get("normalizer")) or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    dropped = _dropped_characters(model, vocab, _has(spec.get("pre_tokenizer"), "ByteLevel"))
    if dropped is None:
        return None
    pieces = [len(p) for p in vocab] + [len(t.get("content", "")) for t in added]
    return PromptLengthBound(max(max(pieces, default=1), 1), dropped)


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    """True when ``normalizer`` never makes a text shorter (in characters)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers") or [])
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(normalizer.get("content", "")) >= len(pattern["String"])
    return False


def _keeps_characters(pre: dict[str, Any] | None) -> bool:
    """True when the pre-tokenizer ``pre`` passes every character on to the model."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre.get("pretokenizers") or [])
    return kind in _KEEPING_PRE_TOKENIZERS and str(pre.get("behavior", "")).lower() != "removed"


def _has(pre: dict[str, Any] | None, kind: str) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has(p, kind) for p in pre.get("pretokenizers") or [])
    return pre.get("type") == kind


def _dropped_characters(
    model: dict[str, Any], vocab: dict[str, int], byte_level: bool
) -> frozenset[str] | None:
    """The characters the BPE ``model`` may turn into no token; None when that set is not known to be finite
    and small (then there is no bound)."""
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return frozenset()  # a character not in the vocabulary becomes its bytes' pieces
    unk = model.get("unk_token")
    if unk is not None and unk in vocab and not model.get("fuse_unk"):
        return frozenset()  # one unknown token per unknown character
    if byte_level:
        from flexspec.engine.token_bytes import gpt2_byte_decoder

        missing = {b for c, b in gpt2_byte_decoder().items() if c not in vocab}
        if not missing & set(range(0x80, 0xC0)):  # every non-ASCII character has a continuation byte
            return frozenset(chr(b) for b in missing if b < 0x80)
    return None
