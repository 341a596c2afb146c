"""A drafting step's greedy verdicts on the GPU in one launch: how many drafts each request keeps, its next token,
and the row it was read from.

engine/verify.py's `greedy_verdicts` (the reference) and the indexing after it (engine/spec_step.py,
`_verdicts_and_drafts`) run as ~8 of torch's kernels a drafting step (a compare, a cast, a cumulative product and
its sum, an arange, two gathers), each a few microseconds of a step that the GPU runs in ~0.9 ms at one session.
Here one program a block of requests reads each one's argmax targets [q] and fed tokens [q] and writes the three
answers; the tapped hidden rows are then one index_select each, by the flat row index.
tests/kernels/test_verdicts.py holds it equal to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton

BLOCK_B = 16  # requests per program


@triton.jit
def _greedy_verdicts_kernel(
    target_ptr, fed_ptr, accepted_ptr, newest_ptr, flat_ptr, B, q, stride_t, stride_f,
    BLOCK_B: tl.constexpr, BLOCK_Q: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Request b keeps drafts while target[b, j] == fed[b, j + 1] (j < q - 1): accepted[b] is the first j where
    they differ (q - 1 if none), newest[b] = target[b, accepted[b]], flat[b] = b * q + accepted[b]."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.arange(0, BLOCK_Q)
    live_b = b < B
    cell = live_b[:, None] & (j < q)[None, :]
    target = tl.load(target_ptr + b[:, None] * stride_t + j[None, :], mask=cell, other=0)
    nxt = (j + 1 < q)[None, :] & live_b[:, None]
    fed_next = tl.load(fed_ptr + b[:, None] * stride_f + (j + 1)[None, :], mask=nxt, other=0)
    stops = (target != fed_next) | ~nxt  # the last row has no draft after it: every request stops there at most
    accepted = tl.min(tl.where(stops, j[None, :], BLOCK_Q), axis=1)
    newest = tl.sum(tl.where(j[None, :] == accepted[:, None], target, 0), axis=1)
    tl.store(accepted_ptr + b, accepted.to(tl.int64), mask=live_b)
    tl.store(newest_ptr + b, newest.to(tl.int64), mask=live_b)
    tl.store(flat_ptr + b, (b * q + accepted).to(tl.int64), mask=live_b)


def greedy_verdicts(target: torch.Tensor, fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """target, fed [B, q] (int64: each request's argmax rows and the tokens it fed) -> (accepted [B], newest [B],
    flat [B]) int64: engine/verify.py's greedy_verdicts, target[b, accepted[b]] and b * q + accepted[b]."""
    assert target.shape == fed.shape and target.dim() == 2 and target.shape[1] >= 1, (target.shape, fed.shape)
    assert target.stride(1) == 1 and fed.stride(1) == 1, (target.stride(), fed.stride())
    n, q = target.shape
    out = torch.empty(3, n, dtype=torch.int64, device=target.device)
    if n:
        _greedy_verdicts_kernel[(triton.cdiv(n, BLOCK_B),)](
            target, fed, out[0], out[1], out[2], n, q, target.stride(0), fed.stride(0), BLOCK_B=BLOCK_B,
            BLOCK_Q=max(2, triton.next_power_of_2(q)), num_warps=1, **pdl.launch_options(target.device),
        )  # fmt: skip
    return out[0], out[1], out[2]
