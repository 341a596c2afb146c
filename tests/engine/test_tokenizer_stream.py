"""Streaming detokenization: what each step's new tokens add to a request's text.

A byte-level tokenizer streams through `ByteStreamDecoder` (each token's bytes into one incremental UTF-8 decoder);
any other through `StreamDecoder` (decoding a short window twice a step). Either way the pieces joined must be the
text of decoding every id at once, special tokens skipped.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers
from tokenizers import normalizers as hf_normalizers

from specchat.engine.tokenizer import ByteStreamDecoder, StreamDecoder, Tokenizer
from tests.tiny_tokenizer import tiny_tokenizer_json

TEXTS = [
    "Hello, world! def f(x):\n    return x * 2",
    "naïve café — 東京 🚀🙂 ü",
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}',
]


def _tiny() -> Tokenizer:
    return Tokenizer(HFTokenizer.from_str(tiny_tokenizer_json(512)), None, "<|im_start|>", "<|im_end|>")


def _streamed(tok: Tokenizer, ids: list[int], rng: random.Random, prompt: list[int] | None = None) -> str:
    """ids pushed in random chunks of 1-5 (a step's emitted tokens), then flushed."""
    stream, text, i = tok.stream(prompt or []), "", 0
    while i < len(ids):
        n = rng.randint(1, 5)
        text += stream.push(ids[i : i + n])
        i += n
    return text + stream.flush()


def test_byte_level_tokenizer_streams_bytes_and_matches_whole_decode():
    tok, rng = _tiny(), random.Random(0)
    assert isinstance(tok.stream([]), ByteStreamDecoder)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert _streamed(tok, ids, rng) == tok.decode(ids) == text
        with_specials = [*ids[:3], tok.backend.token_to_id("<|im_end|>"), *ids[3:]]  # (ignore_eos keeps EOS)
        assert _streamed(tok, with_specials, rng, prompt=ids[:2]) == tok.decode(with_specials) == text


def test_byte_level_stream_holds_back_a_split_character():
    tok = _tiny()
    ids = tok.encode("🚀", add_special_tokens=False)
    stream = tok.stream([])
    pieces = [stream.push([i]) for i in ids]
    assert len(ids) > 1 and "".join(pieces) == "🚀" and pieces[-1] == "🚀" and not any(pieces[:-1])


def test_byte_level_stream_of_random_ids_matches_whole_decode():
    """Random ids (as a random model emits), invalid UTF-8 included: the same replacement characters."""
    tok, rng = _tiny(), random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        assert _streamed(tok, ids, rng) == tok.decode(ids)


def _metaspace() -> HFTokenizer:
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁": 4, "h": 5, "i": 6}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = hf_normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return backend


def test_other_tokenizers_keep_the_window_decoder():
    tok, rng = Tokenizer(_metaspace(), None, None, None), random.Random(2)
    assert isinstance(tok.stream([1]), StreamDecoder)
    ids = [1, 2, 3, 1, 2]
    assert _streamed(tok, ids, rng, prompt=[1]) == " " + tok.decode(ids)  # the window keeps the leading space


def test_byte_level_tokenizer_with_a_plain_added_token_keeps_the_window_decoder():
    backend = HFTokenizer.from_str(tiny_tokenizer_json(512))
    backend.add_tokens(["<tool>"])  # an added token that is not special: decoding writes its text as is
    tok = Tokenizer(backend, None, None, None)
    assert isinstance(tok.stream([]), StreamDecoder)


@pytest.mark.parametrize("text", TEXTS)
def test_the_default_model_tokenizer_streams_its_text(text, default_engine):
    tok, rng = default_engine.tokenizer, random.Random(3)
    ids = tok.encode(text, add_special_tokens=False)
    assert isinstance(tok.stream([]), ByteStreamDecoder)
    assert _streamed(tok, ids, rng) == tok.decode(ids) == text
