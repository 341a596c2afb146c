"""Prompt lookup on the device in one Triton program per request (kernels/ngram.py: what it finds, and
`lookup_ref`, the reference this kernel equals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # positions a program compares at once


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
    min_n: int, max_n: int, window: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`ngram.lookup_ref` in one launch on a Triton device, for n-grams of 1 to 4 tokens."""
    assert 1 <= min_n <= max_n <= 4, (min_n, max_n)
    b = lengths.shape[0]
    drafts = torch.empty(b, k, dtype=torch.long, device=ids.device)
    found = torch.empty(b, dtype=torch.bool, device=ids.device)
    _lookup_kernel[(b,)](
        ids, tables, lengths, newest, drafts, found, tables.stride(0), page_size, window, k,
        MIN_N=min_n, MAX_N=max_n, BLOCK=BLOCK, BLOCK_K=triton.next_power_of_2(k),
    )  # fmt: skip
    return drafts, found
