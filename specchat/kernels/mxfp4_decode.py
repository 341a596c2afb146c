"""Decoding the kernel layout's words (kernels/mxfp4_layout.py) inside a Triton kernel.

Two decoders read the same prepared words; `mxfp4_layout.ELEMENT_BITS` is the bit layout and
`mxfp4_layout.unprepare_weight` its plain-torch inverse, which the kernel tests compare against:

- `decode_bf16_asm` (sm_90, bf16 activations): inline PTX, 13 instructions per 8 weights, straight into the
  bf16 tensor-core operand; the block scale is one bf16x2 multiply per word.
- `decode_float` (float16/float32 activations, and TRITON_INTERPRET=1, which has no inline assembly): integer
  ops to float32, exact E2M1 value times the block scale, in the reference's order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specchat.kernels.mxfp4_layout import PAIR3_MULTIPLIER, PAIR3_SOURCE, PAIR_MASK, PAIR_ROTATIONS

_MASK = tl.constexpr(PAIR_MASK)
_ROT1, _ROT2 = tl.constexpr(PAIR_ROTATIONS[1]), tl.constexpr(PAIR_ROTATIONS[2])
_P3_SOURCE, _P3_MULTIPLIER = tl.constexpr(PAIR3_SOURCE), tl.constexpr(PAIR3_MULTIPLIER)


@triton.jit
def _rotl(w, r: tl.constexpr):
    return (w << r) | (w >> (32 - r))


@triton.jit
def _word_pairs(words):
    """int32 words -> the raw bits of their four bf16x2 pairs (uint32): E2M1 value * 2^-126 as bf16."""
    w = words.to(tl.uint32, bitcast=True)
    p0 = w & _MASK
    p1 = _rotl(w, _ROT1) & _MASK
    p2 = _rotl(w, _ROT2) & _MASK
    p3 = ((w & _P3_SOURCE) * _P3_MULTIPLIER) & _MASK  # three non-overlapping shifted copies: no carries
    return p0, p1, p2, p3


@triton.jit
def _half_to_float(h, multiplier):
    """16 pair bits (sign 15, exponent 8..7, mantissa 6) -> E2M1 value * multiplier in float32."""
    magnitude = (h >> 6) & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    quarters = tl.where(exponent == 0, 2 * mantissa, (2 + mantissa) << exponent)  # 4 * |E2M1|
    value = (quarters.to(tl.float32) * 0.25) * multiplier  # the reference's order: exact E2M1, then scale
    return tl.where((h & 0x8000) != 0, -value, value)


@triton.jit
def decode_float(words, scales, HAS_NAN: tl.constexpr):
    """Portable decode: words and kernel scale bytes (int32) -> 8 float32 tensors (elements e0..e7)."""
    # 2^(s - 127 - c) from its float32 bits: exponent field d = s - c = byte - 126 (subnormal below 1)
    d = scales - 126
    bits = tl.where(d >= 1, d << 23, tl.where(d >= -22, 1 << tl.maximum(22 + d, 0), 0))
    multiplier = bits.to(tl.float32, bitcast=True)
    if HAS_NAN:
        multiplier = tl.where(scales == 0xFF, float("nan"), multiplier)
    p0, p1, p2, p3 = _word_pairs(words)
    return (
        _half_to_float(p0 & 0xFFFF, multiplier),
        _half_to_float(p0 >> 16, multiplier),
        _half_to_float(p1 & 0xFFFF, multiplier),
        _half_to_float(p1 >> 16, multiplier),
        _half_to_float(p2 & 0xFFFF, multiplier),
        _half_to_float(p2 >> 16, multiplier),
        _half_to_float(p3 & 0xFFFF, multiplier),
        _half_to_float(p3 >> 16, multiplier),
    )


_ASM_DECODE_TEMPLATE = f"""{{
.reg .pred nan;
.reg .b32 m, p0, p1, p2, p3, a;
mul.lo.u32 m, $9, 0x00800080;
%s
and.b32 p0, $8, {PAIR_MASK:#x};
shf.l.wrap.b32 a, $8, $8, {PAIR_ROTATIONS[1]};
and.b32 p1, a, {PAIR_MASK:#x};
shf.l.wrap.b32 a, $8, $8, {PAIR_ROTATIONS[2]};
and.b32 p2, a, {PAIR_MASK:#x};
and.b32 a, $8, {PAIR3_SOURCE:#x};
mul.lo.u32 a, a, {PAIR3_MULTIPLIER:#x};
and.b32 p3, a, {PAIR_MASK:#x};
mul.rn.bf16x2 p0, p0, m;
mul.rn.bf16x2 p1, p1, m;
mul.rn.bf16x2 p2, p2, m;
mul.rn.bf16x2 p3, p3, m;
mov.b32 {{$0, $1}}, p0;
mov.b32 {{$2, $3}}, p1;
mov.b32 {{$4, $5}}, p2;
mov.b32 {{$6, $7}}, p3;
}}"""
_ASM_DECODE = tl.constexpr(_ASM_DECODE_TEMPLATE % "")
_ASM_DECODE_NAN = tl.constexpr(_ASM_DECODE_TEMPLATE % "setp.eq.u32 nan, $9, 0xFF;\nselp.b32 m, 0x7FC07FC0, m, nan;")


@triton.jit
def decode_bf16_asm(words, scales, HAS_NAN: tl.constexpr):
    """Fast decode (sm_90), the same math as `_word_pairs`: word, scale code -> 8 bf16 elements e0..e7.

    The bf16x2 multiplier 2^(s - 1 - c) is the scale byte times 0x00800080. It is computed here because any
    arithmetic on the broadcast scales in Triton (or a scalar operand) makes Triton lay the weight tile out
    for the load and convert it to the MMA operand layout through shared memory (seen with triton 3.6).
    """
    if HAS_NAN:  # scale 0xFF -> a NaN multiplier
        elements = tl.inline_asm_elementwise(
            _ASM_DECODE_NAN, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scales], (tl.bfloat16,) * 8, True, 1
        )
    else:
        elements = tl.inline_asm_elementwise(
            _ASM_DECODE, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scales], (tl.bfloat16,) * 8, True, 1
        )
    return elements


@triton.jit
def join4(e0, e1, e2, e3):
    """Four tensors of one shape -> one with a trailing 2 x 2 axis holding e0, e1, e2, e3 in row-major order:
    reshaped, they become four neighbours along the last axis."""
    return tl.join(tl.join(e0, e2), tl.join(e1, e3))


@triton.jit
def word_bytes(words):
    """int32 words -> their bytes 0..3 (little-endian, each 0..255), laid out as `join4` does."""
    return join4(words & 0xFF, (words >> 8) & 0xFF, (words >> 16) & 0xFF, (words >> 24) & 0xFF)
