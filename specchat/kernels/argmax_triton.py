"""The step's argmax on the GPU: each row of logits [R, V] -> the index of its largest entry, in two launches.

torch's argmax reduces each row in one block of threads: over the default model's 49,152 logits it took 13 us of
a 0.8 ms decode step on an H100, one row or five (docs/benchmarks.md, fifty-fourth session). Here the first
launch spreads each row over many programs (`BLOCK_V` entries each), every one keeping its largest entry and
where it is; the second picks each row's winner from those partials. Both chain under programmatic dependent
launch (kernels/pdl.py) with the step's other kernels.

torch.argmax's answer exactly: the first index of the largest value, and in a row holding a NaN, the first NaN
(torch takes NaN for the largest). tests/kernels/test_argmax.py holds the two equal, ties and NaNs included.
`cpu_ops.argmax` sends CUDA tensors here where `fused.argmax_supported`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton

BLOCK_V = 2048  # entries per program of the first launch: 24 programs a row over 49,152 logits


@triton.jit
def _first_best(vals, at_nan, size: tl.constexpr):
    """Position in vals [size] of its first NaN if it holds one, else of its first largest value."""
    nan = vals != vals
    _, at = tl.max(tl.where(nan, float("-inf"), vals), axis=0, return_indices=True, return_indices_tie_break_left=True)
    first_nan = tl.min(tl.where(nan, at_nan, size), axis=0)
    return tl.where(first_nan < size, first_nan, at)


@triton.jit
def _argmax_parts_kernel(
    x_ptr, val_ptr, idx_ptr, V, stride_x, parts, BLOCK_V: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    """Program (row, part): the part's winner (its value and the row's index of it) among its BLOCK_V entries."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_V)
    cols = part * BLOCK_V + offs
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    at = _first_best(x, offs, BLOCK_V)
    tl.store(val_ptr + row * parts + part, tl.sum(tl.where(offs == at, x, 0.0), axis=0))
    tl.store(idx_ptr + row * parts + part, part * BLOCK_V + at)


@triton.jit
def _argmax_rows_kernel(val_ptr, idx_ptr, out_ptr, parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """Program row: the first of its parts' winners that is a NaN or the largest (parts come in index order)."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    live = p < parts
    vals = tl.load(val_ptr + row * parts + p, mask=live, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * parts + p, mask=live, other=0)
    at = _first_best(vals, p, BLOCK_P)
    tl.store(out_ptr + row, tl.sum(tl.where(p == at, idxs, 0), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] (float32, bfloat16 or float16, compared in float32; unit stride along V) -> x.argmax(-1) as int64
    [...]."""
    assert x.dim() >= 1 and x.shape[-1] > 0 and x.stride(-1) == 1, (x.shape, x.stride())
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype  # (float64 would round)
    v = x.shape[-1]
    x2 = x.reshape(-1, v)
    rows, parts = x2.shape[0], triton.cdiv(v, BLOCK_V)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out.view(x.shape[:-1])
    vals = torch.empty(rows, parts, dtype=torch.float32, device=x.device)
    idxs = torch.empty(rows, parts, dtype=torch.int32, device=x.device)
    launch = pdl.launch_options(x.device)
    _argmax_parts_kernel[(rows, parts)](x2, vals, idxs, v, x2.stride(0), parts, BLOCK_V=BLOCK_V, num_warps=8, **launch)
    _argmax_rows_kernel[(rows,)](
        vals, idxs, out, parts, BLOCK_P=max(16, triton.next_power_of_2(parts)), num_warps=1, **launch
    )
    return out.view(x.shape[:-1])
