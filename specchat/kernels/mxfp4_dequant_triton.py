"""A kernel-layout MXFP4 weight dequantized by a Triton kernel: `dequantize_prepared_into` (kernels/mxfp4_dequant.py
says what borrows its output, and holds the plain-layout producer, the CPU's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels.mxfp4_layout import ROW_GROUP, Mxfp4Weight
from specchat.kernels.mxfp4_matmul_kernel import load_tiles, tile_offsets, weight_tile

_ROW_GROUP = tl.constexpr(ROW_GROUP)


@triton.jit
def _dequant_kernel(
    w_ptr,  # [Np/64, Kt/128, 64, 16] int32 prepared words
    s_ptr,  # [Np/64, Kt/128, 64] int32: a row's 4 kernel scale bytes of a k-tile
    out_ptr,  # [rows, K] row-major
    row0,  # the weight's first row to decode (a multiple of 64)
    rows,
    K,
    num_k_tiles,
    stride_out,
    TILES: tl.constexpr,  # k-tiles per program
    FAST: tl.constexpr,  # bf16 out, the inline-assembly decode (sm_90)
    HAS_NAN: tl.constexpr,
):
    """One (64-row group, TILES k-tiles) block of the weight -> out, decoded as the matmul kernel decodes it."""
    Q: tl.constexpr = 4 * TILES
    local = tl.program_id(0) * _ROW_GROUP + tl.arange(0, _ROW_GROUP)
    it = tl.program_id(1)
    _, word_offs, scale_offs = tile_offsets(row0 + local, num_k_tiles, TILES)
    words, scales = load_tiles(w_ptr, s_ptr, word_offs, scale_offs, it, TILES)
    w = weight_tile(words, scales, _ROW_GROUP, Q, FAST, HAS_NAN)  # [64, 32 Q]
    offs_k = it * 32 * Q + tl.arange(0, 32 * Q)
    mask = (local[:, None] < rows) & (offs_k[None, :] < K)
    tl.store(out_ptr + local[:, None] * stride_out + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_prepared_into(weight: Mxfp4Weight, row0: int, out: torch.Tensor) -> torch.Tensor:
    """Kernel-layout weight rows row0 .. row0 + len(out) -> out [rows, K] (bf16 on CUDA: the fast decode;
    otherwise, and under TRITON_INTERPRET=1, the portable one): the reference's values times 2^-exp_offset."""
    assert weight.prepared and row0 % ROW_GROUP == 0 and out.shape[1] == weight.k and out.stride(1) == 1
    assert out.shape[0] > 0 and row0 + out.shape[0] <= weight.n, (row0, out.shape, weight.n)
    num_k_tiles = weight.codes.shape[1]
    tiles = 2 if num_k_tiles % 2 == 0 else 1
    fast = out.is_cuda and out.dtype == torch.bfloat16
    grid = (-(-out.shape[0] // ROW_GROUP), num_k_tiles // tiles)
    _dequant_kernel[grid](
        weight.codes, weight.scales.view(torch.int32), out, row0, out.shape[0], weight.k, num_k_tiles,
        out.stride(0), TILES=tiles, FAST=fast, HAS_NAN=weight.has_nan, num_warps=4,
    )  # fmt: skip
    return out
