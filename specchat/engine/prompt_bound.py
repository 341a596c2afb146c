"""The fewest tokens a text can encode to, told without encoding it: a prompt too long for the context is refused
before it is encoded.

Encoding is linear in the text and slow: a 15.6 MB prompt is 5.8M tokens, ~15 s of work that holds the GIL (a
server's /health and every stream stall meanwhile), only for the prompt to be refused as past the context.

Where a BPE vocabulary spells every text, over bytes or with byte fallback, each character of the normalized text
lands in some token, and a token covers at most as many characters as its vocabulary entry has: a byte-level entry
has one character per byte, a byte-fallback piece one per character (or six for its one byte), an added token its
text. So a text of n characters encodes to at least n / (the longest entry) tokens. The exceptions are counted out:
characters no token spells encode to nothing (SmolLM2's vocabulary lacks some ASCII control bytes), and the
normalizer may shorten the text (NFC composes), so a long text is measured normalized.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models
from tokenizers.normalizers import Normalizer

UTF8_CONTINUATION_BYTES = range(0x80, 0xC0)  # the bytes after the first of a multi-byte character


def byte_level_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: each byte -> the character byte-level vocabularies spell it with (printable ones as
    themselves, the others from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    chars.update((b, chr(256 + i)) for i, b in enumerate(sorted(set(range(256)) - set(printable))))
    return chars


@dataclass(frozen=True, slots=True)
class TokenBound:
    """A tokenizer's bound: the most characters one token covers, and what the count leaves out."""

    max_token_chars: int  # the longest vocabulary entry, added tokens included
    unspelled: tuple[str, ...]  # ASCII characters no token spells: they encode to nothing
    normalizer: Normalizer | None

    @classmethod
    def of(cls, backend: HFTokenizer) -> TokenBound | None:
        """The bound of a tokenizer, or None where it has none: not BPE (WordPiece reads a whole unknown word as one
        [UNK]), BPE without bytes to fall back on (it folds unknown characters into [UNK]), or a vocabulary without a
        byte that a character could lose all of its tokens to."""
        if not isinstance(backend.model, models.BPE):
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        if isinstance(backend.decoder, decoders.ByteLevel):  # a character without its first byte keeps the others
            spelling, needed = byte_level_chars(), UTF8_CONTINUATION_BYTES
        elif backend.model.byte_fallback:  # a character without one of its bytes is an [UNK], fused with others
            spelling, needed = {b: f"<0x{b:02X}>" for b in range(256)}, range(256)
        else:
            return None
        if not all(spelling[b] in vocab for b in needed):
            return None
        unspelled = tuple(chr(b) for b in range(0x80) if spelling[b] not in vocab)
        return cls(max(map(len, vocab)), unspelled, backend.normalizer)

    def reaches(self, text: str, tokens: int) -> int | None:
        """Where `text` surely encodes to `tokens` tokens or more, a lower bound on how many; else None. A text whose
        own length gives fewer is not measured further: only one that long is normalized and counted."""
        if -(-len(text) // self.max_token_chars) < tokens:
            return None
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        spelled = len(text) - sum(text.count(char) for char in self.unspelled)
        at_least = -(-spelled // self.max_token_chars)
        return at_least if at_least >= tokens else None
