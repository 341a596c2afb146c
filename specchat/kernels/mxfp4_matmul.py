"""MXFP4 weight x activation matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, the entry point for Fp4Linear.

The interchange format is `specchat.kernels.mxfp4`'s (codes uint8 [N, K/2], scales uint8 [N, K/32]).
`prepare_weight` turns it, once at load time, into an `Mxfp4Weight` that is the only resident copy, laid out
for the device it sits on; `mxfp4_linear` is F.linear with that weight:

- CUDA: the Triton kernel (kernels/mxfp4_matmul_kernel.py) reads a re-laid-out copy (kernels/mxfp4_layout.py,
  same bytes per weight, K padded to 128, N to 128).
- CPU: the plain codes and scales are dequantized into a scratch buffer that all layers share
  (kernels/mxfp4_dequant.py), then F.linear, so no dequantized copy outlives the call. A weight larger than
  SCRATCH_MAX_WEIGHTS (an output head: 49152 x 576 on the default model) goes through in slices of output
  rows, so the scratch stays the size of a block's largest linear.

`unprepare_weight` gives the interchange form back, bit for bit (e.g. to save a checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4_dequant import DEFAULT_SCRATCH, DequantScratch, dequantize_weight_into
from specchat.kernels.mxfp4_layout import Mxfp4Weight, prepare_weight, unprepare_weight
from specchat.kernels.mxfp4_matmul_kernel import ACTIVATION_DTYPES, mxfp4_matmul_triton

__all__ = ["Mxfp4Weight", "mxfp4_linear", "prepare_weight", "unprepare_weight"]

SCRATCH_MAX_WEIGHTS = 1 << 22  # CPU: weights dequantized at once (16 MiB of float32); larger ones go by rows


def mxfp4_linear(
    x: torch.Tensor, weight: Mxfp4Weight, bias: torch.Tensor | None = None, scratch: DequantScratch | None = None
) -> torch.Tensor:
    """F.linear with an MXFP4 weight: x [..., K] -> [..., N] in x's dtype. CUDA: Triton; CPU: scratch + F.linear."""
    assert x.dtype in ACTIVATION_DTYPES and x.shape[-1] == weight.k, (x.dtype, x.shape, weight.k)
    if x.is_cuda:
        x2 = x.reshape(-1, weight.k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        y = mxfp4_matmul_triton(x2, weight).reshape(*x.shape[:-1], weight.n)
        return y if bias is None else y + bias
    scratch = scratch or DEFAULT_SCRATCH
    if weight.n * weight.k <= SCRATCH_MAX_WEIGHTS:
        dense = scratch.get((weight.n, weight.k), x.dtype, x.device)
        return F.linear(x, dequantize_weight_into(weight, dense), bias)
    rows = max(1, SCRATCH_MAX_WEIGHTS // weight.k)
    y = x.new_empty(*x.shape[:-1], weight.n)
    for r0 in range(0, weight.n, rows):
        r1 = min(r0 + rows, weight.n)
        part = Mxfp4Weight(r1 - r0, weight.k, weight.codes[r0:r1], weight.scales[r0:r1], prepared=False)
        dense = dequantize_weight_into(part, scratch.get((r1 - r0, weight.k), x.dtype, x.device))
        y[..., r0:r1] = F.linear(x, dense, None if bias is None else bias[r0:r1])
    return y
