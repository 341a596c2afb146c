"""Prompt lookup on the device: the n-gram drafts of a drafting step ahead (issue 13).

A request's tokens are on the device beside its keys and values: every forward writes each fed token's id into
the KV pool's slot for its position (`PageStore.ids`), so position p of a request is
ids[table[p // page_size] * page_size + p % page_size]. Given each request's cached length L (positions 0..L-1:
the step's accepted tokens included) and its newest token (position L, not cached yet), the lookup finds what
`NgramIndex.lookup` finds on the host (engine/drafters/ngram.py): for n from max_n down to min_n, the latest
earlier occurrence of the context's last n tokens that ends before the newest token, and the k tokens after it.
Where those run past the newest token (a match within k of the end: the text repeats with a short period), the
device continues the period (draft i = the token at start + i mod (L + 1 - start)), so a step ahead always has k
drafts; the host's lookup stops at the newest token.

Only the last `window` positions are searched (the host's index holds the whole context).

`lookup_ref` is the reference (plain PyTorch over [B, window] tensors, what the CPU runs); `lookup` runs one
Triton program per request on a CUDA device (one launch where the reference is ~30 small kernels; the kernel is in
kernels/ngram_triton.py, imported at the first launch); tests/kernels/test_ngram.py holds them equal, and the
reference equal to `NgramIndex.lookup`.
"""

from __future__ import annotations

import torch

from specchat.kernels.fused import _runs_on

WINDOW = 8192  # positions searched: the default model's whole context


def context_window(
    ids: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, newest: torch.Tensor, page_size: int, window: int
) -> torch.Tensor:
    """[B, window] each request's last `window` tokens (its cached ones through its page table, then the newest),
    -1 before its first position."""
    positions = lengths[:, None] + 1 - window + torch.arange(window, device=lengths.device)  # [B, W]
    valid = positions >= 0
    p = positions.clamp(min=0)
    pages = tables.long().gather(1, (p // page_size).clamp(max=tables.shape[1] - 1))
    tokens = ids[pages * page_size + p % page_size]
    tokens = torch.where(positions == lengths[:, None], newest[:, None], tokens)
    return torch.where(valid, tokens, -1)


def lookup_ref(
    ids: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, newest: torch.Tensor, page_size: int, k: int,
    min_n: int, max_n: int, window: int = WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(drafts [B, k] int64, found [B] bool): see the module's docstring. Drafts of a request without a match are
    meaningless."""
    c = context_window(ids, tables, lengths, newest, page_size, window)  # [B, W]
    b, w = c.shape
    padded = torch.cat([torch.full((b, max_n), -1, dtype=c.dtype, device=c.device), c], 1)
    total = lengths + 1  # tokens of each request, the newest included
    ends = torch.arange(w - 1, device=c.device)  # window index of an n-gram's last token (its follower is inside)
    match = torch.ones(b, w - 1, dtype=torch.bool, device=c.device)
    best = torch.full((b,), -1, dtype=torch.long, device=c.device)  # window index of the chosen n-gram's end
    for n in range(1, max_n + 1):  # match: the n tokens ending at each index equal the context's last n
        match = match & (padded[:, max_n - n + 1 : max_n - n + w] == c[:, w - n : w - n + 1])
        if n < min_n:
            continue
        # the latest end whose n-gram lies inside the request (the query has at least n tokens before it too)
        latest = torch.where(match & (ends >= n - 1), ends, -1).amax(1)
        latest = torch.where(total - 1 >= n, latest, -1)
        best = torch.where(latest >= 0, latest, best)  # longer n come later and win
    found = best >= 0
    start = best + 1  # window index of the first draft
    period = (w - start).clamp(min=1)
    picks = start[:, None] + torch.arange(k, device=c.device) % period[:, None]
    drafts = c.gather(1, picks.clamp(max=w - 1))
    return drafts, found


def lookup(
    ids: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, newest: torch.Tensor, page_size: int, k: int,
    min_n: int, max_n: int, window: int = WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`lookup_ref` in one launch where Triton runs (n-grams of 1 to 4 tokens); the reference elsewhere."""
    if not _runs_on(ids) or not 1 <= min_n <= max_n <= 4:
        return lookup_ref(ids, tables, lengths, newest, page_size, k, min_n, max_n, window)
    from specchat.kernels import ngram_triton

    return ngram_triton.lookup(ids, tables, lengths, newest, page_size, k, min_n, max_n, window)
