"""MXFP4 weight x activation matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, the entry point for Fp4Linear.

The interchange format is `specchat.kernels.mxfp4`'s (codes uint8 [N, K/2], scales uint8 [N, K/32]).
`prepare_weight` turns it, once at load time, into an `Mxfp4Weight` that is the only resident copy, laid out
for the device it sits on; `mxfp4_linear` is F.linear with that weight:

- CUDA: the Triton kernel (kernels/mxfp4_matmul_kernel.py) reads a re-laid-out copy (kernels/mxfp4_layout.py,
  same bytes per weight, K padded to 128, N to 128). From DENSE_MIN_ROWS rows on (prefill chunks), where
  cuBLAS on bf16 weights outruns it, the weight is decoded into the shared scratch buffer instead
  (`dequantize_prepared_into`, a Triton kernel: kernels/mxfp4_dequant_triton.py; at most DENSE_MAX_WEIGHTS at a
  time, by slabs of rows) and multiplied there. Eager steps take it from DENSE_MIN_ROWS rows (below, an eager
  forward is bound by host work and the slabs' extra launches cost more than the GPU saves); the CUDA-graph
  runner captures its prefill graphs within `graphed_steps`, where it is taken from GRAPHED_DENSE_MIN_ROWS: the
  capture's eager warm-ups take the same path, so they compile the decode kernel and grow the scratch, which a
  capture cannot do (a capture takes the copy only where the scratch already holds the slab, else the kernel).
- CPU: the plain codes and scales are dequantized into a scratch buffer that all layers share
  (kernels/mxfp4_dequant.py), then F.linear, so no dequantized copy outlives the call. A weight larger than
  SCRATCH_MAX_WEIGHTS (an output head: 49152 x 576 on the default model) goes through in slices of output
  rows, so the scratch stays the size of a block's largest linear.

`unprepare_weight` gives the interchange form back, bit for bit (e.g. to save a checkpoint). Both Triton modules
are imported at the first launch on CUDA: the CPU path never imports Triton.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4_dequant import DEFAULT_SCRATCH, DequantScratch, dequantize_weight_into
from specchat.kernels.mxfp4_layout import ROW_GROUP, Mxfp4Weight, prepare_weight, unprepare_weight

__all__ = ["Mxfp4Weight", "mxfp4_linear", "prepare_weight", "unprepare_weight"]

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCRATCH_MAX_WEIGHTS = 1 << 22  # CPU: weights dequantized at once (16 MiB of float32); larger ones go by rows
DENSE_MIN_ROWS = 2048  # CUDA, eager steps: this many rows multiply a decoded copy (H200, docs/mxfp4.md)
GRAPHED_DENSE_MIN_ROWS = 512  # CUDA, within `graphed_steps` (prefill graphs, whose launches cost nothing)
DENSE_MAX_WEIGHTS = 1 << 26  # CUDA: weights decoded at once (128 MiB of bf16); larger ones go by slabs of rows


_GRAPHED = [0]  # depth of `graphed_steps`


@contextmanager
def graphed_steps() -> Iterator[None]:
    """Steps run here are (or warm up) CUDA graphs: many rows take the decoded copy from GRAPHED_DENSE_MIN_ROWS."""
    _GRAPHED[0] += 1
    try:
        yield
    finally:
        _GRAPHED[0] -= 1


def mxfp4_linear(
    x: torch.Tensor, weight: Mxfp4Weight, bias: torch.Tensor | None = None, scratch: DequantScratch | None = None
) -> torch.Tensor:
    """F.linear with an MXFP4 weight: x [..., K] -> [..., N] in x's dtype. CUDA: the Triton kernel, or for many
    rows cuBLAS on the weight decoded into scratch; CPU: scratch + F.linear."""
    assert x.dtype in ACTIVATION_DTYPES and x.shape[-1] == weight.k, (x.dtype, x.shape, weight.k)
    scratch = scratch or DEFAULT_SCRATCH
    if x.is_cuda:
        x2 = x.reshape(-1, weight.k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        dense_from = GRAPHED_DENSE_MIN_ROWS if _GRAPHED[0] else DENSE_MIN_ROWS
        if x2.shape[0] >= dense_from and (
            not torch.cuda.is_current_stream_capturing()
            or scratch.holds(_slab_rows(weight, DENSE_MAX_WEIGHTS) * weight.k, x.dtype, x.device)
        ):
            y = dequantized_linear(x2, weight, None, scratch, DENSE_MAX_WEIGHTS)
        else:
            from specchat.kernels import mxfp4_matmul_kernel

            y = mxfp4_matmul_kernel.mxfp4_matmul_triton(x2, weight)
        y = y.reshape(*x.shape[:-1], weight.n)
        return y if bias is None else y + bias
    return dequantized_linear(x, weight, bias, scratch, SCRATCH_MAX_WEIGHTS)


def dequantized_linear(
    x: torch.Tensor, weight: Mxfp4Weight, bias: torch.Tensor | None, scratch: DequantScratch, max_weights: int
) -> torch.Tensor:
    """F.linear(x, dequant(weight), bias) with the weight decoded into scratch, at most max_weights at a time (a
    larger weight, e.g. an output head, goes through in slabs of rows; kernel-layout slabs start at row groups)."""
    rows = _slab_rows(weight, max_weights)
    out_scale = 2.0**weight.exp_offset if weight.prepared else 1.0  # see dequantize_prepared_into
    slab_bias = bias if out_scale == 1.0 else None
    if rows >= weight.n:
        y = F.linear(x, _dequantize_rows(weight, 0, weight.n, x, scratch), slab_bias)
    else:
        y = x.new_empty(*x.shape[:-1], weight.n)
        for r0 in range(0, weight.n, rows):
            r1 = min(r0 + rows, weight.n)
            dense = _dequantize_rows(weight, r0, r1, x, scratch)
            if x.dim() == 2 and slab_bias is None:  # cuBLAS writes the slab's columns in place
                torch.mm(x, dense.t(), out=y[:, r0:r1])
            else:
                y[..., r0:r1] = F.linear(x, dense, None if slab_bias is None else slab_bias[r0:r1])
    if out_scale != 1.0:
        y = y.mul_(out_scale) if bias is None else torch.add(bias, y, alpha=out_scale)
    return y


def _slab_rows(weight: Mxfp4Weight, max_weights: int) -> int:
    """Rows of the weight decoded at once: all, or slabs of at most max_weights (kernel layout: whole row groups)."""
    if weight.n * weight.k <= max_weights:
        return weight.n
    step = ROW_GROUP if weight.prepared else 1
    return max(step, max_weights // weight.k // step * step)


def _dequantize_rows(weight: Mxfp4Weight, r0: int, r1: int, x: torch.Tensor, scratch: DequantScratch) -> torch.Tensor:
    """Rows r0..r1 of the weight, decoded into scratch in x's dtype."""
    out = scratch.get((r1 - r0, weight.k), x.dtype, x.device)
    if weight.prepared:
        from specchat.kernels import mxfp4_dequant_triton

        return mxfp4_dequant_triton.dequantize_prepared_into(weight, r0, out)
    part = Mxfp4Weight(r1 - r0, weight.k, weight.codes[r0:r1], weight.scales[r0:r1], prepared=False)
    return dequantize_weight_into(part, out)
