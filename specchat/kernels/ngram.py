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
Triton program per request on a CUDA device (one launch where the reference is ~30 small kernels);
tests/kernels/test_ngram.py holds them equal, and the reference equal to `NgramIndex.lookup`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels.fused import _runs_on

WINDOW = 8192  # positions searched: the default model's whole context
BLOCK = 1024  # positions a program compares at once


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


@triton.jit
def _token_at(ids_ptr, table_ptr, pos, last, newest, page_size, live):
    page = tl.load(table_ptr + pos // page_size, mask=live & (pos < last), other=0)
    tok = tl.load(ids_ptr + page.to(tl.int64) * page_size + pos % page_size, mask=live & (pos < last), other=-1)
    tok = tl.where(pos == last, newest, tok)
    return tl.where(live, tok, -1)


@triton.jit
def _lookup_kernel(
    ids_ptr, tables_ptr, lengths_ptr, newest_ptr, drafts_ptr, found_ptr,
    stride_t, page_size, window, k,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    table_ptr = tables_ptr + row * stride_t
    last = tl.load(lengths_ptr + row)  # the newest token's position
    newest = tl.load(newest_ptr + row)
    lo = tl.maximum(last + 1 - window, 0)  # the first position searched
    # the query: the context's last MAX_N tokens, q0 the newest
    q1 = _token_at(ids_ptr, table_ptr, last - 1, last, newest, page_size, last - 1 >= lo)
    q2 = _token_at(ids_ptr, table_ptr, last - 2, last, newest, page_size, last - 2 >= lo)
    q3 = _token_at(ids_ptr, table_ptr, last - 3, last, newest, page_size, last - 3 >= lo)
    best1 = tl.full((), -1, tl.int64)  # the latest end of a match of the last 1, 2, 3, 4 tokens
    best2 = tl.full((), -1, tl.int64)
    best3 = tl.full((), -1, tl.int64)
    best4 = tl.full((), -1, tl.int64)
    offs = tl.arange(0, BLOCK)
    for base in range(lo, last, BLOCK):  # n-gram ends e in [lo, last - 1]: each has a follower
        e = base + offs
        m = (_token_at(ids_ptr, table_ptr, e, last, newest, page_size, e < last) == newest) & (e < last)
        best1 = tl.maximum(best1, tl.max(tl.where(m, e, -1), axis=0))
        inside = (e < last) & (e - 1 >= lo)
        if MAX_N >= 2:
            m = m & (_token_at(ids_ptr, table_ptr, e - 1, last, newest, page_size, inside) == q1) & inside
            best2 = tl.maximum(best2, tl.max(tl.where(m, e, -1), axis=0))
        if MAX_N >= 3:
            inside = inside & (e - 2 >= lo)
            m = m & (_token_at(ids_ptr, table_ptr, e - 2, last, newest, page_size, inside) == q2) & inside
            best3 = tl.maximum(best3, tl.max(tl.where(m, e, -1), axis=0))
        if MAX_N >= 4:
            inside = inside & (e - 3 >= lo)
            m = m & (_token_at(ids_ptr, table_ptr, e - 3, last, newest, page_size, inside) == q3) & inside
            best4 = tl.maximum(best4, tl.max(tl.where(m, e, -1), axis=0))
    # the longest n that matched, its query inside the request (n <= last)
    best = tl.where((MIN_N <= 1) & (last >= 1), best1, -1)
    if MAX_N >= 2:
        best = tl.where((MIN_N <= 2) & (best2 >= 0) & (last >= 2), best2, best)
    if MAX_N >= 3:
        best = tl.where((MIN_N <= 3) & (best3 >= 0) & (last >= 3), best3, best)
    if MAX_N >= 4:
        best = tl.where((best4 >= 0) & (last >= 4), best4, best)
    tl.store(found_ptr + row, best >= 0)
    start = best + 1
    period = tl.maximum(last + 1 - start, 1)
    i = tl.arange(0, BLOCK_K)
    want = (i < k) & (i * 0 + best >= 0)  # (a block compare: a splat scalar bool is int32 to the interpreter)
    tok = _token_at(ids_ptr, table_ptr, start + i % period, last, newest, page_size, want)
    tl.store(drafts_ptr + row * k + i, tok, mask=i < k)


def lookup(
    ids: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, newest: torch.Tensor, page_size: int, k: int,
    min_n: int, max_n: int, window: int = WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`lookup_ref` in one launch where Triton runs (n-grams of 1 to 4 tokens); the reference elsewhere."""
    if not _runs_on(ids) or not 1 <= min_n <= max_n <= 4:
        return lookup_ref(ids, tables, lengths, newest, page_size, k, min_n, max_n, window)
    b = lengths.shape[0]
    drafts = torch.empty(b, k, dtype=torch.long, device=ids.device)
    found = torch.empty(b, dtype=torch.bool, device=ids.device)
    _lookup_kernel[(b,)](
        ids, tables, lengths, newest, drafts, found, tables.stride(0), page_size, window, k,
        MIN_N=min_n, MAX_N=max_n, BLOCK=BLOCK, BLOCK_K=triton.next_power_of_2(k),
    )  # fmt: skip
    return drafts, found
