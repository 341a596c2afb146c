"""`ngram+heads`: prompt lookup where the context repeats, trained heads everywhere else.

A match of at least `min_n` tokens in the context (Saxena 2023) is usually right for several tokens at once
(code edits, tool results, agent loops) and costs nothing to find; where there is none, the heads draft
from the target's hidden state (Cai et al. 2024). Per request and per step: the n-gram draft when the lookup
finds one, else the heads' draft. Both are deterministic in greedy decoding; with sampling the n-gram draft
is a point mass and the heads return their q, so verification stays lossless either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specchat.engine.drafters.base import Draft, Drafter
from specchat.engine.drafters.heads import HeadsDrafter
from specchat.engine.drafters.ngram import DEFAULT_MIN_N, NgramDrafter
from specchat.kernels import ngram as ngram_kernels

if TYPE_CHECKING:
    from specchat.engine.runner import TokenContext
    from specchat.engine.sequence import Sequence

MIN_NGRAM = DEFAULT_MIN_N  # a one-token match says too little to beat the heads (or plain decoding)


class NgramThenHeads(Drafter):
    name = "ngram+heads"
    sources = ("ngram",)  # the heads' drafts are the drafter's own ("")
    reads_context = True  # drafting on the device: the lookup reads each request's tokens from the pool

    def __init__(self, heads: HeadsDrafter, min_n: int = MIN_NGRAM, heads_k: int | None = None) -> None:
        """heads_k: the most drafts the heads propose where the n-grams miss (default: heads_cpu.drafting's for
        heads packed for the CPU, else the step's k, as the n-grams); n-gram drafts cost no model call, each head
        draft one head and its output rows."""
        self.ngram = NgramDrafter(min_n=min_n)
        self.heads = heads
        self.heads_k = heads.hybrid_k if heads_k is None else heads_k
        self.taps = heads.taps

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        """Each source drafts at most the k that a request's adaptive controller chose for it (AdaptiveK.limit)."""
        drafts = self.ngram.propose(seqs, [_limit(seq, "ngram", k) for seq, k in zip(seqs, ks, strict=True)])
        for draft in drafts:
            draft.source = "ngram"
        misses = [i for i, d in enumerate(drafts) if not d.tokens]
        heads_ks = {i: _limit(seqs[i], "", min(ks[i], self.heads_k or ks[i])) for i in misses}
        misses = [i for i in misses if heads_ks[i] > 0]
        if misses:
            for i, draft in zip(
                misses, self.heads.propose([seqs[i] for i in misses], [heads_ks[i] for i in misses]), strict=True
            ):
                drafts[i] = draft
        return drafts

    def draft_on_device(
        self, depth: int, hidden: dict[int, torch.Tensor], newest: torch.Tensor, context: TokenContext | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The lookup's drafts where it matches (kernels/ngram.py, over the context's pages), the heads' greedy
        chain elsewhere, and which drafted (1: the n-grams); the chain alone without a context. None where the heads
        cannot draft on the device."""
        chain = self.heads.draft_on_device(depth, hidden, newest)
        if chain is None or context is None:
            return chain
        return self.look_up(chain, newest, context)

    def look_up(
        self, chain: torch.Tensor, newest: torch.Tensor, context: TokenContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' chain [B, depth] with the lookup's drafts where it matches, and which drafted (1: the n-grams):
        `draft_on_device`'s second half, which SpecStep also runs apart, after a captured chain."""
        ngram, found = ngram_kernels.lookup(
            context.ids, context.tables, context.positions, newest, context.page_size, chain.shape[1],
            self.ngram.min_n, self.ngram.max_n,
        )  # fmt: skip
        return torch.where(found[:, None], ngram, chain), found.long()

    def drafts_on_device(self, depth: int | None = None) -> bool:
        return self.heads.drafts_on_device(depth)

    def release(self, seq: Sequence) -> None:
        self.ngram.release(seq)
        self.heads.release(seq)

    def warm_up(self, sessions: int) -> None:
        self.heads.warm_up(sessions)


def _limit(seq: Sequence, source: str, k: int) -> int:
    return k if seq.adaptive is None else seq.adaptive.limit(source, k)
