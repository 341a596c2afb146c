"""Prompt lookup decoding (Saxena 2023): draft by copying what followed an earlier match of the context's tail.

Take the last n tokens of prompt + output; if the same n tokens occurred earlier, propose the tokens that
followed that occurrence. n runs from `max_n` down to `min_n` (longer matches are more specific), and the most
recent earlier occurrence wins (in code edits and agent loops the latest copy is usually the one being
repeated). A match within k of the end (a loop of a few tokens) continues its period to k drafts, as the device's
lookup does (kernels/ngram.py). Costs no model call at all: strong where the output repeats its context, silent
elsewhere.

Each request keeps an index {n-gram: position just after its latest occurrence}, extended incrementally as
tokens arrive; a request's tokens only ever grow (rejected drafts never enter them), so the index never needs
rolling back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specchat.engine.drafters.base import Draft, Drafter
from specchat.errors import ConfigError

if TYPE_CHECKING:
    from specchat.engine.sequence import Sequence

# A one-token match says too little: on the CPU (int8 rows, k = 4, one thread) drafting from matches of 2 tokens or
# more took n-gram drafting from 1.18x to 1.26x plain decoding over the eval prompts, and on free-form prompts from
# 0.89x (a loss) to 1.05x (docs/benchmarks.md). The hybrid drafter's n-grams use the same floor.
DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one request's tokens last ended, with a continuation."""

    min_n: int
    max_n: int
    indexed: int = 0  # n-grams ending before this position are in `follows`
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position right after it

    def extend(self, tokens: list[int], offset: int = 0) -> None:
        """Index every n-gram that ends before the newest token (so that each has at least one follower).
        `tokens` are the request's from position `offset` on (at most `window_start`: what this reads)."""
        end = offset + len(tokens) - 1  # the n-gram ending at the newest token is the query, not an entry
        for stop in range(max(self.indexed, 1), end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self.follows[tuple(tokens[stop - n - offset : stop - offset])] = stop
        self.indexed = max(self.indexed, end + 1)

    def window_start(self, num_tokens: int) -> int:
        """The first position extend and lookup read of a request of num_tokens tokens (n-grams not indexed
        yet, and the query at the end)."""
        return max(0, min(max(self.indexed, 1), num_tokens - 1) - self.max_n)

    def lookup(
        self, tokens: list[int], k: int, offset: int = 0, read: Callable[[int, int], list[int]] | None = None
    ) -> list[int]:
        """The k tokens that followed the longest earlier match of the context's tail; where they would run past
        the newest token (the match is within k of the end: the text repeats with a period shorter than k), the
        period continued. With `offset` > 0, `tokens` start at that position and read(start, stop) gives any
        earlier ones."""
        total = offset + len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self.follows.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                if start >= offset or read is None:
                    draft = tokens[start - offset : start - offset + k]
                else:
                    draft = read(start, min(start + k, total))
                return draft if len(draft) == k else [draft[i % len(draft)] for i in range(k)]
        return []


class NgramDrafter(Drafter):
    """Prompt lookup: a deterministic drafter (point-mass drafts), no model call."""

    name = "ngram"

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            index = self.indexes.setdefault(seq.seq_id, NgramIndex(self.min_n, self.max_n))
            # only the newest tokens: joining prompt and output every step made a lookup at a 4,000-token
            # context ~20 us instead of ~5
            offset = index.window_start(seq.num_tokens)
            tokens = seq.tokens_from(offset)
            index.extend(tokens, offset)
            drafts.append(Draft(index.lookup(tokens, k, offset, seq.tokens_from)))
        return drafts

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)
