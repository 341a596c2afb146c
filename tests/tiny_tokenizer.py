"""The tiny random models' tokenizer: a byte-level BPE with ChatML, built in the test session, so that no test on
a tiny model downloads the default model for its tokenizer.

The merges are learned from the shipped prompt set (specchat/data/prompts: chat, code, math, JSON tool calls), so
prompts encode to about as many tokens as with a real tokenizer. Only the 250 prompts first shipped count (each
file's first lines, FIRST_LINES): the set has grown since, and a tokenizer that followed it would change the tiny
models' token ids, and so their random answers, under tests tuned on them. The vocabulary is then filled up to the
model's size with made-up words (" baka", " dodemi", ...) that no text encodes to, so that every id a random model
emits decodes to visible text. Special tokens take ids 0, 1, 2, where the tiny config puts them (bos 1, eos 2).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import specchat

CORPUS_DIR = Path(specchat.__file__).parent / "data" / "prompts"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|im_end|>",
    "chat_template": CHATML_TEMPLATE,
}
FIRST_LINES = {"chat": 52, "code": 64, "code_edit": 40, "math": 52, "tool_use": 42}  # the prompts first shipped
SPACE = "\u0120"  # how byte-level BPE spells a space ("Ġ")


def _corpus() -> Iterator[str]:
    """Every message of the prompts first shipped."""
    for path in sorted(CORPUS_DIR.glob("*.jsonl")):
        for line in path.read_text().splitlines()[: FIRST_LINES[path.stem]]:
            for message in json.loads(line)["messages"]:
                yield message["content"]


def _made_up_words() -> Iterator[str]:
    """ " baba", " babe", ... then three syllables: filler tokens, in byte-level spelling."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    for count in itertools.count(2):
        for parts in itertools.product(syllables, repeat=count):
            yield SPACE + "".join(parts)


@functools.cache
def tiny_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json text of exactly `vocab_size` tokens (learned merges, then made-up words)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    words = (word for word in _made_up_words() if word not in vocab)
    vocab.update((word, token_id) for token_id, word in zip(range(len(vocab), vocab_size), words, strict=False))
    assert len(vocab) == vocab_size and [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2]
    return json.dumps(data, ensure_ascii=False)


def save_tiny_tokenizer(path: Path, vocab_size: int) -> Path:
    """tokenizer.json and tokenizer_config.json (ChatML template, <|im_end|> as eos) in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(vocab_size))
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    return path
