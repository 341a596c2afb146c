"""A Triton GEMV for dense (bf16/fp16) weights and a few rows: y[M, N] = x[M, K] @ W[N, K]^T, M <= MAX_ROWS.

Why, when cuBLAS has one: a small model's decode step on the GPU is a chain of ~300 kernels of a few microseconds
each (the default model: 30 layers, weights of 0.7-3.5 MB), bound by each kernel's launch and ramp, not by bytes.
The step's other kernels are ours and chain with programmatic dependent launch (kernels/pdl.py), but a cuBLAS
kernel between them breaks the chain at every linear. This kernel takes the linears into the chain: under PDL it
prefetches its first weight tiles into the L2 while the kernel before it still runs, then waits for its input.
On the H200 (docs/benchmarks.md, thirty-seventh and thirty-eighth sessions), under PDL, it runs the default model's
linears at M = 1 at 1.06-1.52x cuBLAS's speed (gate_up's gated form 1.12x cuBLAS's gate_up alone, without its SiLU
kernel), at 4-16 rows 1.01-1.38x with the launches `choose_config` picks by rows (gated gate_up ~1.0x); the default
model decodes 1.21x faster at one session with it (1,078-1,083 -> 1,312-1,317 tok/s on CUDA graphs), 1.15x at 8.

`gated=True` multiplies by a fused gate_up weight [2I, K] and returns silu(gate) * up [M, I] (engine/model.py's
MLP): each program computes BLOCK_N gate rows and the same up rows, so the SiLU-and-mul kernel and the
[M, 2I] round trip go away. The gate and up values are rounded to x's dtype first and then combined as
kernels/fused_triton.py's `silu_mul` combines them, so the result equals `silu_mul(dense_gemv(x, W))` bit for bit where
both run the same launch configuration (the sums' order follows it).

y^T = W @ x^T on the tensor cores (tl.dot, fp32 accumulation) with x's rows padded to 16; the portable path
(`fast=False`: float32 products, the interpreter's) is the same code with the operands cast up. The reference is
F.linear (tests/kernels/test_dense_gemv.py).

The kernel and its launcher, `dense_gemv`, are in kernels/dense_gemv_triton.py. This module says where it runs
(`supported`, `wanted`) and how it is launched (`choose_config`), and imports no Triton: the CPU path asks it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specchat.kernels.fused import INTERPRET

MAX_ROWS = 16  # one 16-row tile of x (the MMA's n); more rows go to cuBLAS
DTYPES = (torch.bfloat16, torch.float16)
ENABLED = os.environ.get("SPECCHAT_DENSE_GEMV", "1") != "0"  # read once; SPECCHAT_DENSE_GEMV=0: cuBLAS (A/B runs)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch parameters of `_dense_gemv_kernel` (kernels/dense_gemv_triton.py)."""

    block_n: int = 16
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def choose_config(n: int, k: int, gated: bool = False, m: int = 1) -> GemvConfig:
    """The launch for m rows and n outputs of a [n, k] weight (gated: of a [2n, k] one), from the H200 sweeps
    (`benchmarks/dense_gemv.py --sweep`, PDL on, the default model's shapes): an output head's many rows in 64-row
    programs of 2 warps; the rest at one row (decoding) in 32-row programs of 256-wide steps where gated or K is
    long, else 16-row programs of 128-wide steps. With more rows (verification) gate_up's gated pairs take 128-wide
    steps (4.2 us against 5.3-5.9 at 4 and 16 rows) and a long K 16-row programs of 4 warps (4.3 us against
    4.4-5.3)."""
    if n >= 16384:
        return GemvConfig(block_n=64, block_k=64, num_warps=2)
    if m > 1 and gated:
        return GemvConfig(block_n=32, block_k=128, num_warps=2)
    if m > 1 and k >= 1024:
        return GemvConfig(block_n=16, block_k=256, num_warps=4)
    if gated or k >= 1024:
        return GemvConfig(block_n=32, block_k=256, num_warps=2)
    return GemvConfig(block_n=16, block_k=128)


def supported(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `dense_gemv` takes this call: CUDA (or the interpreter on the CPU), bf16/fp16, at most MAX_ROWS rows
    of unit stride, a contiguous weight (and bias) of x's dtype."""
    runs = x.is_cuda or (INTERPRET and x.device.type == "cpu")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (
        runs
        and x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.device == x.device
        and 1 <= rows <= MAX_ROWS
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def wanted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the engine's fused linears (engine/fusion.py) take this call here: `supported`, unless
    SPECCHAT_DENSE_GEMV=0 keeps every dense linear on cuBLAS (A/B benchmarks)."""
    return ENABLED and supported(x, weight, bias)
