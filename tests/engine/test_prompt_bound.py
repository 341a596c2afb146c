"""TokenBound: the fewest tokens a text can encode to, told without encoding it. It must never claim more tokens than
encoding gives (a prompt that fits would be refused), and it must reach the context for a text far too long."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from tokenizers import normalizers as hf_normalizers

from specchat.engine.prompt_bound import TokenBound, byte_level_chars
from tests.tiny_tokenizer import SPECIAL_TOKENS, tiny_tokenizer_json

# Texts that pack the most characters into each token: long runs of one character, the vocabulary's longest words
ADVERSARIAL = [
    "=" * 3000,
    " " * 3000,
    "\n" + " " * 3000,
    "#" * 3000,
    " dodemi baka" * 300,
    "".join(SPECIAL_TOKENS) * 200,
    "東京 🚀🙂 naïve café " * 200,
    "e\u0301" * 2000,  # a letter and a combining accent: NFC composes the two into one character
    "\x04\x06\x13" * 1000,
    "lorem ipsum dolor sit amet " * 200,
]


@pytest.fixture(scope="module")
def tiny() -> HFTokenizer:
    return HFTokenizer.from_str(tiny_tokenizer_json(49152))


def without_byte(tokenizer_json: str, byte: int) -> HFTokenizer:
    """The tokenizer without the token of one byte (as SmolLM2's vocabulary lacks \\x04, \\x06 and others)."""
    data = json.loads(tokenizer_json)
    char = byte_level_chars()[byte]
    vocab = data["model"]["vocab"]
    vocab.pop(char)
    data["model"]["merges"] = [m for m in data["model"]["merges"] if char not in "".join(m)]
    data["model"]["vocab"] = {token: i for i, token in enumerate(sorted(vocab, key=vocab.get))}
    return HFTokenizer.from_str(json.dumps(data))


@pytest.mark.parametrize("normalizer", [None, hf_normalizers.NFC(), hf_normalizers.NFKC()])
@pytest.mark.parametrize("text", ADVERSARIAL)
def test_the_bound_never_claims_more_tokens_than_encoding_gives(tiny, text, normalizer):
    backend = HFTokenizer.from_str(tiny.to_str())
    backend.normalizer = normalizer
    bound = TokenBound.of(backend)
    tokens = len(backend.encode(text).ids)
    assert bound.reaches(text, tokens + 1) is None
    assert bound.reaches(text, 1) <= tokens


def test_a_text_far_past_the_context_reaches_it(tiny):
    bound = TokenBound.of(tiny)
    text = "lorem ipsum dolor sit amet " * 2000
    at_least = bound.reaches(text, 256)
    assert at_least is not None and 256 <= at_least <= len(tiny.encode(text).ids)
    assert bound.reaches("lorem ipsum", 256) is None


def test_characters_no_token_spells_are_not_counted(tiny):
    backend = without_byte(tiny.to_str(), 0x04)
    bound = TokenBound.of(backend)
    assert bound.unspelled == ("\x04",) and backend.encode("\x04" * 100).ids == []  # encodes to nothing
    assert bound.reaches("\x04" * 100_000, 1) is None


def test_a_normalizer_that_shortens_the_text_is_applied_before_counting(tiny):
    backend = HFTokenizer.from_str(tiny.to_str())
    backend.normalizer = hf_normalizers.NFC()
    bound = TokenBound.of(backend)
    text = "e\u0301" * 4000  # 8000 characters, 4000 once composed
    assert bound.max_token_chars == 16
    assert bound.reaches(text, 500) is None and bound.reaches(text, 250) == 250


def test_tokenizers_that_fold_unknown_characters_have_no_bound(tiny):
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    bpe_with_unk = HFTokenizer(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))
    assert TokenBound.of(wordpiece) is None and TokenBound.of(bpe_with_unk) is None
    assert TokenBound.of(without_byte(tiny.to_str(), 0x80)) is None  # a continuation byte: "é" could lose both
