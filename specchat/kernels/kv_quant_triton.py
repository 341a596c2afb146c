"""Quantize-on-append of KV rows in one Triton program per (token, KV head), bit for bit the torch reference of
kernels/kv_quant.py (read its docstring first: the element formats and their scale rules).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton
from specchat.kernels.kv_quant import MXFP4, MXFP8, PageTensor, triton_supported
from specchat.kernels.mxfp4 import RULES

_FMT_IDS = {MXFP4: 1, MXFP8: 2}
_RULE_IDS = {rule: i for i, rule in enumerate(RULES)}  # ocp, roundup, mse


@triton.jit
def pow2(e):
    """Exact float32 2^e for int32 e in [-127, 127] (2^-127 is a subnormal)."""
    return tl.where(e > -127, (e + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) for float32 a > 0 from the exponent field; -127 for 0 and subnormals."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _e2m1_magnitude_code(v):
    """|v| (already divided by the block scale) -> E2M1 magnitude code 0..7, round to nearest, ties to even.

    The code is the number of grid midpoints below |v|; at a midpoint the even neighbour wins, as in
    `specchat.kernels.mxfp4.round_to_e2m1` (E2M1_MIDPOINTS, E2M1_TIE_ROUNDS_UP).
    """
    m = tl.abs(v)
    code = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
    code += (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    return code


@triton.jit
def _e2m1_value(code):
    """Magnitude code 0..7 -> value: 0, 0.5 for exponent 0, else (2 + mantissa) * 2^(exponent - 2)."""
    e = code >> 1
    m = (code & 1).to(tl.float32)
    return tl.where(e == 0, 0.5 * m, (2.0 + m) * pow2(e - 2))


@triton.jit
def _squared_error(lo, hi, shift):
    """Per block: squared error of rounding lo/hi [NB, 16] (in units of the ocp scale) on the grid 2^shift [NB].

    Working in units of the ocp scale keeps the errors of tiny blocks from underflowing float32.
    """
    scale = pow2(shift)[:, None]
    inv = pow2(-shift)[:, None]
    d_lo = _e2m1_value(_e2m1_magnitude_code(lo * inv)) * scale - tl.abs(lo)
    d_hi = _e2m1_value(_e2m1_magnitude_code(hi * inv)) * scale - tl.abs(hi)
    return tl.sum(d_lo * d_lo, axis=1) + tl.sum(d_hi * d_hi, axis=1)


@triton.jit
def _sign_bit(x):
    return (x.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def _round_half_even(y):
    """Round y >= 0 to the nearest integer, ties to even."""
    f = tl.floor(y)
    d = y - f
    odd = (f.to(tl.int32) & 1) == 1
    return (f + ((d > 0.5) | ((d == 0.5) & odd)).to(tl.float32)).to(tl.int32)


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [T, KVH, D] float
    slots_ptr,  # [T] int64
    codes_ptr,  # [KVH, S, code bytes] uint8
    scales_ptr,  # [KVH, S, D/32] uint8
    stride_xt,
    stride_xh,
    stride_ch,
    stride_cs,
    stride_sh,
    stride_ss,
    FMT: tl.constexpr,  # 1 = MXFP4, 2 = MXFP8
    RULE: tl.constexpr,  # MXFP4 only: 0 ocp, 1 roundup, 2 mse
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)
    NB: tl.constexpr = HEAD_DIM // 32
    slot = tl.load(slots_ptr + t)
    row = x_ptr + t * stride_xt + head * stride_xh
    code_row = codes_ptr + head * stride_ch + slot * stride_cs
    blk = tl.arange(0, NB)[:, None]
    if FMT == 1:
        i = tl.arange(0, 16)[None, :]
        lo = tl.load(row + blk * 32 + 2 * i).to(tl.float32)  # [NB, 16] elements 2i of each block
        hi = tl.load(row + blk * 32 + 2 * i + 1).to(tl.float32)  # [NB, 16] elements 2i + 1
        finite = tl.min(((lo == lo) & (tl.abs(lo) < float("inf"))).to(tl.int32), axis=1)
        finite = finite & tl.min(((hi == hi) & (tl.abs(hi) < float("inf"))).to(tl.int32), axis=1)
        amax = tl.where(finite == 1, tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1)), 0.0)
        ocp = _floor_log2(amax) - 2  # OCP: floor(log2 amax) - emax(E2M1)
        exponent = tl.maximum(ocp, -127)
        if RULE == 1:  # round up: the next exponent when amax / 2^ocp > 6
            exponent = exponent + (amax * pow2(-exponent) > 6.0).to(tl.int32)
        if RULE == 2:  # least squared error of ocp, ocp + 1, ocp - 1 (earlier wins ties)
            unit = pow2(-exponent)[:, None]
            best_err = _squared_error(lo * unit, hi * unit, exponent - exponent)
            for offset in tl.static_range(2):
                candidate = tl.minimum(tl.maximum(ocp + 1 - 2 * offset, -127), 127)
                err = _squared_error(lo * unit, hi * unit, candidate - exponent)
                exponent = tl.where(err < best_err, candidate, exponent)
                best_err = tl.minimum(err, best_err)
        exponent = tl.minimum(exponent, 127)
        inv = pow2(-exponent)[:, None]
        code_lo = _e2m1_magnitude_code(lo * inv) | (_sign_bit(lo) << 3)
        code_hi = _e2m1_magnitude_code(hi * inv) | (_sign_bit(hi) << 3)
        packed = tl.where(finite[:, None] == 1, code_lo | (code_hi << 4), 0)
        tl.store(code_row + blk * 16 + i, packed.to(tl.uint8))
    else:
        i = tl.arange(0, 32)[None, :]
        x = tl.load(row + blk * 32 + i).to(tl.float32)  # [NB, 32]
        finite = tl.min(((x == x) & (tl.abs(x) < float("inf"))).to(tl.int32), axis=1)
        amax = tl.where(finite == 1, tl.max(tl.abs(x), axis=1), 0.0)
        exponent = tl.maximum(_floor_log2(amax) - 8, -127)  # 8 = emax(E4M3)
        exponent = exponent + (amax * pow2(-exponent) > 448.0).to(tl.int32)
        exponent = tl.minimum(exponent, 127)
        v = tl.abs(x) * pow2(-exponent)[:, None]  # <= 448
        e = _floor_log2(v)
        subnormal = e < -6  # E4M3 subnormals step by 2^-9; a result of 8 is the smallest normal, code 8
        r = _round_half_even(v * pow2(tl.where(subnormal, 9, 3 - e)))
        magnitude = tl.where(subnormal, r, ((e + 7) << 3) + r - 8)  # r = 16 carries into the exponent
        code = tl.where(finite[:, None] == 1, magnitude | (_sign_bit(x) << 7), 0)
        tl.store(code_row + blk * 32 + i, code.to(tl.uint8))
    scale = tl.where(finite == 1, exponent + 127, 255)
    tl.store(scales_ptr + head * stride_sh + slot * stride_ss + tl.arange(0, NB), scale.to(tl.uint8))


def quantize_into_pages(x: torch.Tensor, slots: torch.Tensor, pages: PageTensor) -> None:
    """Quantize rows x [T, KVH, D] into `pages` at slots [T], one program per (token, KV head)."""
    t, kv_heads, head_dim = x.shape
    assert pages.fmt in _FMT_IDS, pages.fmt
    assert triton_supported(head_dim), f"head_dim {head_dim}: needs a power-of-two number of 32-element blocks"
    assert x.stride(-1) == 1 and slots.shape == (t,) and slots.dtype == torch.long, (x.stride(), slots.shape)
    assert pages.data.shape[0] == kv_heads and pages.data.stride(-1) == 1, pages.data.shape
    assert pages.data.device == x.device == slots.device, (pages.data.device, x.device, slots.device)
    if t == 0:
        return
    _quantize_rows_kernel[(t, kv_heads)](
        x,
        slots,
        pages.data,
        pages.scales,
        x.stride(0),
        x.stride(1),
        pages.data.stride(0),
        pages.data.stride(1),
        pages.scales.stride(0),
        pages.scales.stride(1),
        FMT=_FMT_IDS[pages.fmt],
        RULE=_RULE_IDS[pages.rule],
        HEAD_DIM=head_dim,
        **pdl.launch_options(x.device),
    )
