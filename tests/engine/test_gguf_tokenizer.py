"""A GGUF's byte-level BPE vocabulary converted directly (tokenizer.byte_level_bpe) encodes every text as
transformers' GGUF converter does, for each pre-tokenizer it knows and each BOS / EOS setting; any other tokenizer
still goes through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specchat.engine import tokenizer as tok
from specchat.engine.gguf_file import GGUFFile
from specchat.engine.tokenizer import Tokenizer, byte_level_bpe, export_gguf_tokenizer
from tests.tiny_tokenizer import CHATML_TEMPLATE, tiny_tokenizer_json

VOCAB = 600
EXTRA = ["<think>", "<tool call>", "naïve"]  # user-defined; control outside the byte alphabet; normal, respelled
TEXTS = [
    "Hello, world! It's 2024; we've got 12345 cats.",
    "def f(x):\n    return x ** 2  # squared\n\n\n",
    "  leading spaces and trailing   ",
    "ünïcödé ✓ 中文 emoji 🙂 naïve",
    "<|im_start|>user\nhi<|im_end|>\n<think>ok</think>",
    "I'LL SEE YOU'RE HERE\r\n\tTabs",
]


def write_vocabulary(path: Path, pre: str | None, model: str = "gpt2", add_bos: bool = False, add_eos=False) -> Path:
    from gguf import GGUFWriter, TokenType

    data = json.loads(tiny_tokenizer_json(VOCAB))["model"]
    tokens = [*sorted(data["vocab"], key=data["vocab"].get), *EXTRA]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["merges"]]
    types = [TokenType.CONTROL if i < 3 else TokenType.NORMAL for i in range(VOCAB)]
    types += [TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.NORMAL]
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_head_count(2)
    writer.add_context_length(64)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    writer.add_chat_template(CHATML_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_tokenizer(path: Path, folder: Path) -> Tokenizer:
    tok._transformers_conversion(path).save_pretrained(str(folder))
    return Tokenizer.from_dir(folder)


@pytest.mark.parametrize(
    ("pre", "add_bos", "add_eos"),
    [(None, False, False), ("smollm", False, False), ("llama-bpe", True, False), ("qwen2", False, True)],
)
def test_the_direct_conversion_encodes_as_transformers(tmp_path, pre, add_bos, add_eos):
    path = write_vocabulary(tmp_path / "v.gguf", pre, add_bos=add_bos, add_eos=add_eos)
    conversion = byte_level_bpe(GGUFFile(path))
    assert conversion is not None
    conversion.save(tmp_path / "ours")
    ours, theirs = Tokenizer.from_dir(tmp_path / "ours"), transformers_tokenizer(path, tmp_path / "theirs")
    mine = json.loads((tmp_path / "ours" / "tokenizer.json").read_text())
    expected = json.loads((tmp_path / "theirs" / "tokenizer.json").read_text())
    for key in ("model", "pre_tokenizer", "decoder", "added_tokens", "normalizer"):
        assert mine[key] == expected[key], key
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, special), (text, special)
    ids = ours.encode(TEXTS[4], False)
    assert ours.decode(ids, False) == theirs.decode(ids, False) and ours.decode(ids) == theirs.decode(ids)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.stop_token_ids == theirs.stop_token_ids
    messages = [{"role": "user", "content": TEXTS[0]}]
    assert ours.encode_chat(messages) == theirs.encode_chat(messages)
    assert ours.encode("hi")[:1] == ([1] if add_bos else ours.encode("hi", False)[:1])


def test_other_tokenizers_go_through_transformers(tmp_path, monkeypatch):
    """A pre-tokenizer the direct conversion does not know (transformers may) and a SentencePiece vocabulary are
    not built directly; the first still converts, through transformers."""
    unknown = write_vocabulary(tmp_path / "tekken.gguf", "tekken")
    assert byte_level_bpe(GGUFFile(unknown)) is None
    assert byte_level_bpe(GGUFFile(write_vocabulary(tmp_path / "spm.gguf", None, model="llama"))) is None
    called = []
    original = tok._transformers_conversion
    monkeypatch.setattr(tok, "_transformers_conversion", lambda p: called.append(p) or original(p))
    converted = export_gguf_tokenizer(unknown, tmp_path / "converted")
    assert called == [unknown] and converted.encode(TEXTS[0], False)
    direct = export_gguf_tokenizer(write_vocabulary(tmp_path / "v.gguf", None), tmp_path / "direct")
    assert called == [unknown] and direct.encode(TEXTS[0], False)  # not through transformers


def test_a_vocabulary_that_does_not_hold_its_merges_is_a_bad_file(tmp_path, monkeypatch):
    """A merge of tokens the vocabulary lacks ends in one ModelFormatError naming the file; a pre-tokenizer that is
    not a name leaves the file to transformers' converter."""
    from specchat.errors import ModelFormatError

    gguf = GGUFFile(write_vocabulary(tmp_path / "v.gguf", None))
    monkeypatch.setitem(gguf.metadata, "tokenizer.ggml.merges", ["no such", *gguf.metadata["tokenizer.ggml.merges"]])
    with pytest.raises(ModelFormatError, match=r"v\.gguf: cannot build the GGUF tokenizer"):
        byte_level_bpe(gguf)
    monkeypatch.setitem(gguf.metadata, "tokenizer.ggml.pre", ["llama-bpe"])
    assert byte_level_bpe(gguf) is None
