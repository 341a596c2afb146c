"""The drafter interface.

A drafter proposes up to k tokens per request for the positions after the request's newest token. It never
touches the target's KV cache. A deterministic drafter returns probs=None (a point mass on each token);
a sampling drafter returns the distribution q it drew each token from, which verification needs to stay
lossless. Drafters that read the target's hidden states list the layers in `taps`; the engine then keeps,
for each request, the tapped hidden state of the position that produced its newest token (`seq.hidden`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specchat.errors import ConfigError

if TYPE_CHECKING:
    from specchat.engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] or None for a point mass


class Drafter:
    """Base class: proposes nothing."""

    name = "none"
    taps: tuple[int, ...] = ()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Up to ks[i] draft tokens for seqs[i]."""
        return [Draft([]) for _ in seqs]

    def release(self, seq: Sequence) -> None:
        """Forget any per-request state (the request finished)."""


class NoDrafter(Drafter):
    """Plain decoding."""


def make_drafter(name: str, context) -> Drafter:
    """A drafter by its CLI name; `context` is the engine (model, tokenizer, config) it may need."""
    if name == "none":
        return NoDrafter()
    raise ConfigError(f"unknown drafter {name!r} (available: none)")
