"""Incremental detokenization: streamed deltas == one full decode, on the fast (DecodeStream) and the
prefix/read-offset paths, across multi-byte characters split over tokens and special tokens."""

import pytest

from flexspec.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    " Hello wörld ñ 日本語 emoji 😀 🇫🇷 and code `def f(x): return x**2`\n\tindent  two  spaces",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "Ünïcödé — “quotes” … €100 ≈ ¥",
]


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(engine, text, fast):
    tok = engine.tokenizer
    prompt = engine.apply_chat_template([{"role": "user", "content": "Say something."}])
    out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # special token: skipped
    d = IncrementalDetokenizer(tok, prompt)
    if not fast:
        d._stream = None  # the prefix/read-offset path used for slow tokenizers
    deltas = [d.add(t) for t in out]
    expected = tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == d.text == expected
    assert not any("\ufffd" in x for x in deltas), "a delta split a multi-byte character"
