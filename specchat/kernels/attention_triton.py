"""The Triton paged attention for decode and verification: the kernels and their launcher, `paged_attention`.

kernels/attention.py holds the terms, the torch reference and where the kernel runs (read it first).

The kernel is split-KV ("flash-decoding", Dao et al. 2023): program (partition, KV head, request) runs an
online softmax (Milakov & Gimelshein 2018) over one slice of the context for all query rows of its KV group
(q_len tokens x H/KVH heads, so each key tile is read once for the whole group), and a second kernel merges
the partitions. Quantized tiles are decoded in registers, never written back:

- MXFP8 codes are E4M3 bytes, which sm_89+ converts to fp16 two at a time (`cvt.rn.f16x2.e4m3x2`). An MXFP4
  code (E2M1: sign, 2 exponent bits, mantissa) becomes an E4M3 byte by placing its bits, the sign at bit 7 and
  the rest at bits 2..4: its value times 2^-6 (exponent 0 lands on E4M3 subnormals, which are exactly E2M1's 0
  and 0.5 times 2^-6), so a word of 8 nibbles takes ~7 logic ops and 4 conversions. (Head_dim 32 reads bytes and
  places each nibble straight into fp16 bits 15 and 11..9: its value times 2^-14.)
- One fp16 multiply per element applies 2^(s - r + e), where s is the element's E8M0 block scale, e the decode's
  exponent (6 for MXFP4, 0 for MXFP8) and r a reference: for keys the largest scale of the element's row, and
  2^(r - 127) multiplies that key's scores in fp32; for values the largest in the tile, and 2^(r - 127)
  multiplies the tile's contribution to the output. Elements more than 2^24 below their reference round to
  zero: a negligible term in a dot product over head_dim and a softmax-weighted sum.
- Quantized pages put the keys on the MMA's rows (`KEY_ROWS`): scores^T = K Q^T and out^T = V^T P^T, so the
  decoded tiles are the register operand of Hopper's warpgroup MMA with M = 128 keys, and the group's few query
  rows its N (H200, 32k context, batch 16: 527 -> 452 us; dense pages stay query-rows, 504 against 540 us).
- MXFP4 packs elements 2j and 2j + 1 in byte j, so its tiles are split into even and odd columns, and the
  query (keys) or the output (values) is split alike; dense and MXFP8 tiles are split into two halves.
- Quantized codes are read as int32 words and the scales as 2- or 4-byte words (`_kernel_views`): loads wide
  enough for cp.async to pipeline. On CUDA inline PTX decodes a word, two elements per conversion and f16x2
  multiply (`_fp4_words`, `_fp8_words`); the interpreter computes the same values per element. Quantized pages
  take longer tiles, more partitions and two pipeline stages (QUANT_*: measured on the H200).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton
from specchat.kernels.attention import AttentionMetadata, fill_partitions, paged_attention_supported
from specchat.kernels.device import sm_count
from specchat.kernels.kv_quant import DENSE, MXFP4, MXFP8, PageTensor
from specchat.kernels.kv_quant_triton import pow2
from specchat.kernels.mxfp4_decode import join4, word_bytes

BLOCK_N = 64  # keys per tile
MIN_BLOCK_M = 16  # query rows per program are padded to a tensor-core tile
PROGRAMS_PER_SM = 4  # decode grids aim at this many programs per SM, rounded to whole waves (`fill_partitions`)
# Quantized pages: longer tiles and twice the partitions (H200, 32k context, batch 16: 964 -> 488 us, against
# 505 us for bf16 pages at their defaults; docs/benchmarks.md, "Seventh lease"); 8 = 3 waves of 3 programs an SM
QUANT_BLOCK_N = 128
QUANT_PROGRAMS_PER_SM = 8
QUANT_NUM_STAGES = 2  # keys as rows, 32k, batch 16: k8v4 562 -> 483 us, MXFP4 452 -> 450 (3 stages -> 2)
INTERPRETER_PROGRAMS = 4  # the same target under TRITON_INTERPRET=1 (no SMs to fill; keep it fast)
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FMT_IDS = {DENSE: 0, MXFP4: 1, MXFP8: 2}
_NEG_BIG = tl.constexpr(-1.0e30)  # running max of a row that has seen no key yet (finite: exp2(-inf - -inf) is NaN)


@triton.jit
def _fp4_to_f16(code):
    """E2M1 nibble (bits 0..3 of an int32) -> fp16 equal to its value times 2^-14."""
    bits = ((code & 0x8) << 12) | ((code & 0x7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_to_f16(code):
    """E4M3 byte (an int32 0..255) -> fp16 equal to its value times 2^-8."""
    bits = ((code & 0x80) << 8) | ((code & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _f16x2_pow2(k):
    """int32 k <= 15 -> the bits of the fp16x2 pair (2^k, 2^k); 0 below fp16's smallest subnormal 2^-24."""
    e = k + 15
    h = tl.where(e >= 1, e << 10, tl.where(k >= -24, 1 << tl.maximum(k + 24, 0), 0))
    return h * 0x10001  # both halves: one IMAD


# Decoding a code word on CUDA (`DECODE`): sm_89 and newer convert E4M3 to fp16 in one instruction; before that
# the codes' bits are moved into fp16 places. The portable path (the interpreter) computes the same values.
DECODE_PORTABLE, DECODE_BITS, DECODE_E4M3 = 0, 1, 2


def _e4m3_word_asm(setup: tuple[str, ...], halves: tuple[str, ...], mult: int) -> str:
    """PTX (sm_89+): `setup` leaves two E4M3 bytes in each 16-bit register of `halves`; each pair converts to fp16
    (`cvt.rn.f16x2.e4m3x2`) and one f16x2 multiply by operand $mult scales it into outputs 2i and 2i + 1."""
    lines = [".reg .b32 p;", *setup]
    for i, half in enumerate(halves):
        lines += [
            f"cvt.rn.f16x2.e4m3x2 p, {half};",
            f"mul.rn.f16x2 p, p, ${mult};",
            f"mov.b32 {{${2 * i}, ${2 * i + 1}}}, p;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


# E2M1 nibble -> E4M3 byte: the sign to bit 7 and the 3 magnitude bits to bits 2..4 is the nibble's value times
# 2^-6 (E2M1's exponent lands on E4M3's low exponent bits; exponent 0 on E4M3's subnormals, which are exactly 0 and
# 0.5 times 2^-6). Bytes' low nibbles (e): sign up 4, magnitude up 2; high nibbles (o): sign in place, magnitude
# down 2. Word $8, multiplier $9; outputs $0..$3 the low nibbles of bytes 0..3, $4..$7 the high ones.
_ASM_FP4_E4M3 = tl.constexpr(
    _e4m3_word_asm(
        (
            ".reg .b32 t, u, e, o;",
            ".reg .b16 e0, e1, o0, o1;",
            "shl.b32 t, $8, 4;",
            "and.b32 t, t, 0x80808080;",
            "shl.b32 u, $8, 2;",
            "and.b32 u, u, 0x1C1C1C1C;",
            "or.b32 e, t, u;",
            "shr.b32 u, $8, 2;",
            "and.b32 u, u, 0x1C1C1C1C;",
            "and.b32 t, $8, 0x80808080;",
            "or.b32 o, t, u;",
            "mov.b32 {e0, e1}, e;",
            "mov.b32 {o0, o1}, o;",
        ),
        ("e0", "e1", "o0", "o1"),
        9,
    )
)
# E4M3 bytes convert as they are: outputs $0..$3 bytes 0..3 of word $4, scaled by $5.
_ASM_FP8_E4M3 = tl.constexpr(_e4m3_word_asm((".reg .b16 l, h;", "mov.b32 {l, h}, $4;"), ("l", "h"), 5))


def _f16x2_word_asm(word: int, mult: int, pairs: tuple[tuple[int, int, int, int, int], ...]) -> str:
    """PTX (any sm_80+) that turns the code word in operand $word into fp16 pairs. For each (byte selector, sign
    shift, magnitude shift, magnitude mask, first output): `prmt` moves two of the word's bytes to the top byte of
    each 16-bit half, the sign bits and the magnitude bits are shifted into their fp16 places (a positive shift is
    to the left), and one f16x2 multiply by operand $mult scales the pair into outputs first and first + 1."""

    def shift(dst: str, n: int) -> str:
        return f"shl.b32 {dst}, y, {n};" if n > 0 else f"shr.b32 {dst}, y, {-n};" if n < 0 else f"mov.b32 {dst}, y;"

    lines, selector = [".reg .b32 z, y, t, u;", "mov.b32 z, 0;"], None
    for sel, sign, magnitude, mask, first in pairs:
        if sel != selector:
            lines.append(f"prmt.b32 y, ${word}, z, {sel:#06x};")
            selector = sel
        lines += [
            shift("t", sign),
            "and.b32 t, t, 0x80008000;",
            shift("u", magnitude),
            f"and.b32 u, u, {mask:#010x};",
            "or.b32 t, t, u;",
            f"mul.rn.f16x2 t, t, ${mult};",
            f"mov.b32 {{${first}, ${first + 1}}}, t;",
        ]
    return "{\n" + "\n".join(lines) + "\n}"


# E2M1 nibbles into fp16 bits 15 and 11..9 (the value times 2^-14): bytes 0, 1 (selector 0x1404) then 2, 3
# (0x3424); the low nibble's sign (bit 11 of its half) moves up 4 and its magnitude (bits 8..10) up 1, the high
# nibble's sign stays at 15 and its magnitude (12..14) moves down 3. Outputs as `_ASM_FP4_E4M3`'s.
_ASM_FP4_BITS = tl.constexpr(
    _f16x2_word_asm(
        8,
        9,
        (
            (0x1404, 4, 1, 0x0E000E00, 0),
            (0x1404, 0, -3, 0x0E000E00, 4),
            (0x3424, 4, 1, 0x0E000E00, 2),
            (0x3424, 0, -3, 0x0E000E00, 6),
        ),
    )
)
# E4M3 bytes into fp16 bits 15 and 13..7 (the value times 2^-8): the 7 magnitude bits (8..14) move down 1.
_ASM_FP8_BITS = tl.constexpr(_f16x2_word_asm(4, 5, ((0x1404, 0, -1, 0x3F803F80, 0), (0x3424, 0, -1, 0x3F803F80, 2))))


@triton.jit
def _word_exponent(FMT: tl.constexpr, DECODE: tl.constexpr):
    """What a decoded code word's multiplier must add: the decode gives each MXFP4 (FMT 1) / MXFP8 (FMT 2) value
    times 2^-6 / 2^0 through E4M3 (and in the portable path), 2^-14 / 2^-8 by bit placement."""
    if DECODE == 1:
        return 14 if FMT == 1 else 8
    else:
        return 6 if FMT == 1 else 0


@triton.jit
def _fp4_words(words, mult, DECODE: tl.constexpr):
    """MXFP4 code words (int32: bytes 0..3, each element 2j low and 2j + 1 high nibble) and their fp16x2
    multipliers -> 8 fp16 tensors: a0..a3 the low nibbles of bytes 0..3 (even elements), b0..b3 the high ones
    (odd), each value x 2^-`_word_exponent` x the multiplier, by inline PTX on CUDA (DECODE_E4M3: ~7 logic ops
    make a word's E4M3 bytes, one conversion + one f16x2 multiply each pair; DECODE_BITS: a byte permute and ~4
    logic ops + one multiply a pair), else element by element."""
    if DECODE == 2:
        return tl.inline_asm_elementwise(
            _ASM_FP4_E4M3, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, mult], (tl.float16,) * 8, True, 1
        )
    elif DECODE == 1:
        return tl.inline_asm_elementwise(
            _ASM_FP4_BITS, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, mult], (tl.float16,) * 8, True, 1
        )
    else:
        rel = (mult & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) * 256.0  # the codes are values x 2^-14
        return (
            _fp4_to_f16(words & 0xF) * rel,
            _fp4_to_f16((words >> 8) & 0xF) * rel,
            _fp4_to_f16((words >> 16) & 0xF) * rel,
            _fp4_to_f16((words >> 24) & 0xF) * rel,
            _fp4_to_f16((words >> 4) & 0xF) * rel,
            _fp4_to_f16((words >> 12) & 0xF) * rel,
            _fp4_to_f16((words >> 20) & 0xF) * rel,
            _fp4_to_f16((words >> 28) & 0xF) * rel,
        )


@triton.jit
def _fp8_words(words, mult, DECODE: tl.constexpr):
    """MXFP8 (E4M3) code words and their fp16x2 multipliers -> 4 fp16 tensors, bytes 0..3 of each word, as
    `_fp4_words` (DECODE_E4M3: one conversion and one f16x2 multiply a pair)."""
    if DECODE == 2:
        return tl.inline_asm_elementwise(_ASM_FP8_E4M3, "=h,=h,=h,=h,r,r", [words, mult], (tl.float16,) * 4, True, 1)
    elif DECODE == 1:
        return tl.inline_asm_elementwise(_ASM_FP8_BITS, "=h,=h,=h,=h,r,r", [words, mult], (tl.float16,) * 4, True, 1)
    else:
        rel = (mult & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True) * 256.0  # the codes are values x 2^-8
        return (
            _fp8_to_f16(words & 0xFF) * rel,
            _fp8_to_f16((words >> 8) & 0xFF) * rel,
            _fp8_to_f16((words >> 16) & 0xFF) * rel,
            _fp8_to_f16((words >> 24) & 0xFF) * rel,
        )


@triton.jit
def _scale_bytes(scale_ptr, slots, valid, stride_ss, NB: tl.constexpr, SB: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's E8M0 scales [BLOCK_N, NB] int32, read as words of SB bytes (scale_ptr typed to match) so that
    the load is wide enough for cp.async."""
    if SB == 1:
        s = tl.load(scale_ptr + slots[:, None] * stride_ss + tl.arange(0, NB)[None, :], mask=valid[:, None], other=0)
        return s.to(tl.int32)
    else:
        sw = tl.load(
            scale_ptr + slots[:, None] * stride_ss + tl.arange(0, NB // SB)[None, :], mask=valid[:, None], other=0
        ).to(tl.int32)
        s = tl.join(sw & 0xFF, (sw >> 8) & 0xFF) if SB == 2 else word_bytes(sw)
        return s.reshape(BLOCK_N, NB)


@triton.jit
def _load_tile(
    data_ptr,  # this KV head's rows
    scale_ptr,  # this KV head's E8M0 scales (unused for dense)
    slots,  # [BLOCK_N] int64
    valid,  # [BLOCK_N] bool
    stride_s,
    stride_ss,
    FMT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SB: tl.constexpr,  # quantized: data_ptr is int32 words, scale_ptr SB-byte words (see `_kernel_views`)
    DECODE: tl.constexpr,
    ROWWISE: tl.constexpr = False,
):
    """A key or value tile as two column halves [BLOCK_N, HEAD_DIM / 2] and its factor (see the docstring): a
    scalar, the tile's largest scale, or with ROWWISE (keys: the factor scales a score column) [BLOCK_N], each
    row's largest, which needs no reduction across the tile."""
    HALF: tl.constexpr = HEAD_DIM // 2
    NB: tl.constexpr = HEAD_DIM // 32
    rows = data_ptr + slots[:, None] * stride_s  # [BLOCK_N, 1]
    if FMT == 0:
        d = tl.arange(0, HALF)[None, :]
        a = tl.load(rows + d, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        b = tl.load(rows + HALF + d, mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        factor = 1.0
    else:
        # int32 words of codes (16-byte loads) and SB-byte words of scales: both wide enough for cp.async
        s = _scale_bytes(scale_ptr, slots, valid, stride_ss, NB, SB, BLOCK_N)  # [BLOCK_N, NB]
        if ROWWISE:
            s_row = tl.max(s, axis=1)  # [BLOCK_N]
            s_ref = s_row[:, None]
            factor = pow2(s_row - 127)
        else:
            s_ref = tl.max(tl.max(s, axis=1), axis=0)
            factor = pow2(s_ref - 127)
        if FMT == 1 and NB == 1:
            # head_dim 32 (one block a row): byte by byte (the word path below measured wrong at this width on
            # the H200 under triton 3.6, while right under the interpreter)
            rel = pow2(tl.maximum(s - s_ref, -40) + 14).to(tl.float16)  # [BLOCK_N, 1]
            byte_rows = data_ptr.to(tl.pointer_type(tl.uint8)) + slots[:, None] * (stride_s * 4)
            codes = tl.load(byte_rows + tl.arange(0, HALF)[None, :], mask=valid[:, None], other=0).to(tl.int32)
            a = _fp4_to_f16(codes) * rel
            b = _fp4_to_f16(codes >> 4) * rel
        elif FMT == 1:
            # word w: bytes 4 w .. 4 w + 3, elements 2 j (low nibble, -> a) and 2 j + 1 (high, -> b); block w // 4
            NW: tl.constexpr = HEAD_DIM // 8
            words = tl.load(rows + tl.arange(0, NW)[None, :], mask=valid[:, None], other=0)  # [BLOCK_N, NW]
            mult = _f16x2_pow2(tl.maximum(s - s_ref, -40) + _word_exponent(1, DECODE))  # [BLOCK_N, NB]
            mult = tl.broadcast_to(mult[:, :, None], (BLOCK_N, NB, 4)).reshape(BLOCK_N, NW)
            a0, a1, a2, a3, b0, b1, b2, b3 = _fp4_words(words, mult, DECODE)
            a = join4(a0, a1, a2, a3).reshape(BLOCK_N, HALF)
            b = join4(b0, b1, b2, b3).reshape(BLOCK_N, HALF)
        else:
            # blocks 0 .. NB/2 - 1 -> a, the rest -> b; a half's word w holds its bytes 4 w .. 4 w + 3, block w // 8
            HB: tl.constexpr = NB // 2
            NW: tl.constexpr = HEAD_DIM // 8  # words per half
            s_a, s_b = tl.split(tl.permute(s.reshape(BLOCK_N, 2, HB), (0, 2, 1)))  # [BLOCK_N, HB] each
            mult_a = _f16x2_pow2(tl.maximum(s_a - s_ref, -40) + _word_exponent(2, DECODE))
            mult_b = _f16x2_pow2(tl.maximum(s_b - s_ref, -40) + _word_exponent(2, DECODE))
            mult_a = tl.broadcast_to(mult_a[:, :, None], (BLOCK_N, HB, 8)).reshape(BLOCK_N, NW)
            mult_b = tl.broadcast_to(mult_b[:, :, None], (BLOCK_N, HB, 8)).reshape(BLOCK_N, NW)
            w = tl.arange(0, NW)[None, :]
            words_a = tl.load(rows + w, mask=valid[:, None], other=0)
            words_b = tl.load(rows + NW + w, mask=valid[:, None], other=0)
            a0, a1, a2, a3 = _fp8_words(words_a, mult_a, DECODE)
            b0, b1, b2, b3 = _fp8_words(words_b, mult_b, DECODE)
            a = join4(a0, a1, a2, a3).reshape(BLOCK_N, HALF)
            b = join4(b0, b1, b2, b3).reshape(BLOCK_N, HALF)
    return a, b, factor


# the partials' strides follow the partition count: unspecialised, every count runs one compiled kernel
@triton.jit(do_not_specialize=["stride_mt", "stride_mh"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    part_out_ptr,  # [T, H, P, D] fp32: unnormalised partial outputs
    part_max_ptr,  # [T, H, P] fp32: running max (log2 units)
    part_sum_ptr,  # [T, H, P] fp32: softmax denominators
    k_ptr,
    k_scale_ptr,
    v_ptr,
    v_scale_ptr,
    tables_ptr,  # [B, max pages] int32
    q_starts_ptr,
    q_lens_ptr,
    ctx_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_ksh,
    stride_kss,
    stride_vh,
    stride_vs,
    stride_vsh,
    stride_vss,
    stride_tb,
    stride_ot,
    stride_oh,
    stride_op,
    stride_mt,
    stride_mh,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,  # bytes per scale word: 4, 2 or 1 (HEAD_DIM / 32 of them per row)
    DECODE: tl.constexpr,  # DECODE_*: how code words become fp16 (the GPU's; portable under TRITON_INTERPRET=1)
    KEY_ROWS: tl.constexpr,  # keys as the MMA's rows (see `paged_attention`)
    OFFSETS: tl.constexpr,  # tl.int32 where every page tensor has fewer than 2^31 elements (cheaper addresses)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pdl_triton.wait(PDL)
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    HALF: tl.constexpr = HEAD_DIM // 2
    ctx_len = tl.load(ctx_lens_ptr + req)
    q_len = tl.load(q_lens_ptr + req)
    q_start = tl.load(q_starts_ptr + req)
    # each request's own context split evenly over the partitions, in whole tiles (not the batch's longest or a
    # CUDA graph's context bucket: a 32k context in the 64k bucket would leave half the partitions empty)
    span = tl.cdiv(tl.cdiv(ctx_len, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    start = part * span
    end = tl.minimum(start + span, ctx_len)

    # query rows: row r is new token r // GROUP of the request, query head kv_head * GROUP + r % GROUP
    r = tl.arange(0, BLOCK_M)
    token = q_start + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_valid = r // GROUP < q_len
    last_key = ctx_len - q_len + r // GROUP  # causal: the last position each row sees
    d = tl.arange(0, HALF)
    q_row = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if K_FMT == 1:
        qa_col, qb_col = 2 * d, 2 * d + 1
    else:
        qa_col, qb_col = d, HALF + d
    q_a = tl.load(q_row + qa_col[None, :], mask=row_valid[:, None], other=0.0).to(tl.float32)
    q_b = tl.load(q_row + qb_col[None, :], mask=row_valid[:, None], other=0.0).to(tl.float32)
    q_a = (q_a * qk_scale).to(DOT_DTYPE)  # [BLOCK_M, HALF]
    q_b = (q_b * qk_scale).to(DOT_DTYPE)

    m_i = tl.full((BLOCK_M,), _NEG_BIG, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    KEYS: tl.constexpr = 0 if KEY_ROWS else 1  # the scores' axis of keys
    if KEY_ROWS:  # scores^T = K Q^T and out^T = V^T P^T: keys are the MMA's rows, the query rows its columns
        acc_a = tl.zeros((HALF, BLOCK_M), tl.float32)
        acc_b = tl.zeros((HALF, BLOCK_M), tl.float32)
        q_a = tl.trans(q_a)
        q_b = tl.trans(q_b)
    else:
        acc_a = tl.zeros((BLOCK_M, HALF), tl.float32)
        acc_b = tl.zeros((BLOCK_M, HALF), tl.float32)
    k_head = k_ptr + kv_head * stride_kh
    k_scale_head = k_scale_ptr + kv_head * stride_ksh
    v_head = v_ptr + kv_head * stride_vh
    v_scale_head = v_scale_ptr + kv_head * stride_vsh
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(tables_ptr + req * stride_tb + pos // PAGE_SIZE, mask=valid, other=0)
        slots = page.to(OFFSETS) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]

        k_a, k_b, k_factor = _load_tile(
            k_head, k_scale_head, slots, valid, stride_ks, stride_kss, K_FMT, HEAD_DIM, BLOCK_N, DOT_DTYPE,
            SB, DECODE, K_FMT != 0,
        )  # fmt: skip
        v_a, v_b, v_factor = _load_tile(
            v_head, v_scale_head, slots, valid, stride_vs, stride_vss, V_FMT, HEAD_DIM, BLOCK_N, DOT_DTYPE,
            SB, DECODE,
        )  # fmt: skip
        if KEY_ROWS:
            scores = tl.dot(k_a, q_a, input_precision=PRECISION)
            scores = tl.dot(k_b, q_b, scores, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
            visible = (pos[:, None] <= last_key[None, :]) & valid[:, None]
        else:
            scores = tl.dot(q_a, tl.trans(k_a), input_precision=PRECISION)
            scores = tl.dot(q_b, tl.trans(k_b), scores, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
            visible = (pos[None, :] <= last_key[:, None]) & valid[None, :]
        scores *= tl.expand_dims(k_factor, 1 - KEYS) if K_FMT != 0 else k_factor
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=KEYS))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - tl.expand_dims(m_new, KEYS))
        l_i = l_i * alpha + tl.sum(p, axis=KEYS)
        p = p.to(DOT_DTYPE)
        if KEY_ROWS:
            pv_a = tl.dot(tl.trans(v_a), p, input_precision=PRECISION)
            pv_b = tl.dot(tl.trans(v_b), p, input_precision=PRECISION)
        else:
            pv_a = tl.dot(p, v_a, input_precision=PRECISION)
            pv_b = tl.dot(p, v_b, input_precision=PRECISION)
        acc_a = acc_a * tl.expand_dims(alpha, KEYS) + pv_a * v_factor
        acc_b = acc_b * tl.expand_dims(alpha, KEYS) + pv_b * v_factor
        m_i = m_new
    pdl_triton.launch_dependents(PDL)  # the merge launches as the partitions finish (kernels/pdl.py)

    if V_FMT == 1:
        oa_col, ob_col = 2 * d, 2 * d + 1
    else:
        oa_col, ob_col = d, HALF + d
    out_row = part_out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + part * stride_op
    if KEY_ROWS:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)
    tl.store(out_row + oa_col[None, :], acc_a, mask=row_valid[:, None])
    tl.store(out_row + ob_col[None, :], acc_b, mask=row_valid[:, None])
    stat = token * stride_mt + head * stride_mh + part
    tl.store(part_max_ptr + stat, m_i, mask=row_valid)
    tl.store(part_sum_ptr + stat, l_i, mask=row_valid)


@triton.jit
def _merge_partitions_kernel(
    part_out_ptr,  # [T, H, P, D] fp32
    part_max_ptr,  # [T, H, P]
    part_sum_ptr,
    out_ptr,  # [T, H, D]
    num_parts,
    stride_ot,
    stride_oh,
    stride_op,
    stride_mt,
    stride_mh,
    stride_yt,
    stride_yh,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = sum_p 2^(m_p - m) acc_p / sum_p 2^(m_p - m) l_p, m = max_p m_p: one program per (token, head)."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    live = p < num_parts
    stat = t * stride_mt + h * stride_mh + p
    m = tl.load(part_max_ptr + stat, mask=live, other=_NEG_BIG)
    l_p = tl.load(part_sum_ptr + stat, mask=live, other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # [BLOCK_P]
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        part_out_ptr + t * stride_ot + h * stride_oh + p[:, None] * stride_op + d[None, :],
        mask=live[:, None],
        other=0.0,
    )  # [BLOCK_P, D]
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_p * w, axis=0)
    tl.store(out_ptr + t * stride_yt + h * stride_yh + d, out.to(out_ptr.dtype.element_ty))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def paged_attention(
    q: torch.Tensor,
    k_pages: PageTensor,
    v_pages: PageTensor,
    meta: AttentionMetadata,
    scale: float,
    num_partitions: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    key_rows: bool | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
    decode: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: causal attention of each request's new rows over its paged context.

    num_partitions: how many slices each request's context is split into (default: `fill_partitions`);
    block_n (keys per tile; default BLOCK_N, QUANT_BLOCK_N for quantized pages), num_warps, key_rows (keys as
    the MMA's rows; default: for quantized pages), num_stages and max_registers (per thread) are launch settings
    for benchmarks to sweep; decode (DECODE_*; default: the device's best) lets tests run each decode.
    """
    quantized = k_pages.fmt != DENSE
    if block_n is None:
        block_n = QUANT_BLOCK_N if quantized else BLOCK_N
    t, num_heads, head_dim = q.shape
    kv_heads = k_pages.data.shape[0]
    group = num_heads // kv_heads
    assert num_heads == group * kv_heads, (num_heads, kv_heads)
    assert paged_attention_supported(head_dim, group, meta.max_q_len), (head_dim, group, meta.max_q_len)
    assert q.dtype in KV_DTYPES and q.stride(-1) == 1, (q.dtype, q.stride())
    assert k_pages.fmt in (DENSE, MXFP4, MXFP8) and v_pages.fmt in (DENSE, MXFP4), (k_pages.fmt, v_pages.fmt)
    assert (k_pages.fmt == DENSE) == (v_pages.fmt == DENSE), "dense keys go with dense values"
    for pages in (k_pages, v_pages):
        assert pages.data.shape[0] == kv_heads and pages.data.stride(-1) == 1, pages.data.shape
        assert pages.data.device == q.device, (pages.data.device, q.device)
    assert meta.page_size & (meta.page_size - 1) == 0, meta.page_size
    assert meta.block_tables.dtype == torch.int32 and meta.q_lens.shape[0] == meta.batch_size

    if k_pages.fmt == DENSE:
        assert k_pages.data.dtype in KV_DTYPES and v_pages.data.dtype == k_pages.data.dtype
        dot_dtype = k_pages.data.dtype
        if dot_dtype == torch.bfloat16 and _interpreting():
            dot_dtype = torch.float32  # the interpreter's numpy dot has no bf16
    else:
        dot_dtype = torch.float16  # decoded codes are exact fp16 (see the module docstring)

    batch = meta.batch_size
    k_data, k_scales = _kernel_views(k_pages)
    v_data, v_scales = _kernel_views(v_pages)
    pdl_options = pdl.launch_options(q.device)
    constexprs = dict(
        K_FMT=_FMT_IDS[k_pages.fmt],
        V_FMT=_FMT_IDS[v_pages.fmt],
        DOT_DTYPE=_TL_DTYPES[dot_dtype],
        PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=meta.page_size,
        BLOCK_M=max(MIN_BLOCK_M, triton.next_power_of_2(group * meta.max_q_len)),
        BLOCK_N=block_n,
        SB=_scale_word_bytes(head_dim),
        DECODE=decode if decode is not None else _decode(q.device),
        KEY_ROWS=quantized if key_rows is None else key_rows,
        OFFSETS=tl.int32 if max(t.numel() for t in (k_data, k_scales, v_data, v_scales)) < 2**31 else tl.int64,
        num_warps=num_warps,
        num_stages=num_stages or (QUANT_NUM_STAGES if quantized else 3),
        **({"maxnreg": max_registers} if max_registers else {}),
        **pdl_options,
    )

    def kernel_args(partitions: int) -> tuple:
        """The kernel's arguments for `partitions` slices of the context, the partials' buffers first."""
        part_out = torch.empty(t, num_heads, partitions, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(t, num_heads, partitions, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        return (
            q, part_out, part_max, part_sum, k_data, k_scales, v_data, v_scales,
            meta.block_tables, meta.q_starts, meta.q_lens, meta.ctx_lens, scale * math.log2(math.e),
            q.stride(0), q.stride(1), k_data.stride(0), k_data.stride(1), k_scales.stride(0), k_scales.stride(1),
            v_data.stride(0), v_data.stride(1), v_scales.stride(0), v_scales.stride(1), meta.block_tables.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_max.stride(0), part_max.stride(1),
        )  # fmt: skip

    if num_partitions is None:
        if _interpreting():
            num_partitions = triton.cdiv(INTERPRETER_PROGRAMS, batch * kv_heads)
        else:
            key = (q.device, *constexprs.values())
            grid = (2, kv_heads, batch)  # compiled only: the partition count specialises nothing
            resident = _resident_programs(
                q.device, key, lambda: _paged_attention_kernel.warmup(*kernel_args(2), grid=grid, **constexprs)
            )
            per_sm = QUANT_PROGRAMS_PER_SM if quantized else PROGRAMS_PER_SM
            num_partitions = fill_partitions(batch * kv_heads, sm_count(q.device), resident, per_sm, meta.max_q_len)
    num_partitions = max(1, min(num_partitions, triton.cdiv(meta.max_ctx_len, block_n)))
    args = kernel_args(num_partitions)
    _paged_attention_kernel[(num_partitions, kv_heads, batch)](*args, **constexprs)
    part_out, part_max, part_sum = args[1:4]
    out = torch.empty_like(q)
    _merge_partitions_kernel[(t, num_heads)](
        part_out,
        part_max,
        part_sum,
        out,
        num_partitions,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_P=triton.next_power_of_2(num_partitions),
        **pdl_options,
    )
    return out


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _scale_word_bytes(head_dim: int) -> int:
    """Scale bytes the kernel reads per word: as many of a row's head_dim / 32 as fit in 4."""
    return math.gcd(head_dim // 32, 4)


def _kernel_views(pages: PageTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) as the kernel reads them: quantized codes as int32 words and scales as words of
    `_scale_word_bytes` (the same memory, read in wider loads); dense data as stored (scales unused)."""
    if pages.fmt == DENSE:
        return pages.data, pages.data
    scale_dtype = _WORD_DTYPES[_scale_word_bytes(pages.scales.shape[-1] * 32)]
    return pages.data.view(torch.int32), pages.scales.view(scale_dtype)


@functools.cache
def _decode(device: torch.device) -> int:
    """DECODE_E4M3 from sm_89 (which converts E4M3 in one instruction), DECODE_BITS on older GPUs, and the
    portable decode under the interpreter."""
    if _interpreting() or device.type != "cuda":
        return DECODE_PORTABLE
    return DECODE_E4M3 if torch.cuda.get_device_capability(device) >= (8, 9) else DECODE_BITS


_RESIDENT: dict[tuple, int] = {}


def _resident_programs(device: torch.device, key: tuple, compile_kernel) -> int:
    """Programs of one attention kernel config an SM holds at once, from its compiled registers and shared
    memory (as Triton's tutorials compute occupancy), cached by config."""
    if key not in _RESIDENT:
        kernel = compile_kernel()
        kernel._init_handles()  # loads the binary, which sets n_regs
        sm = torch.cuda.get_device_properties(device)
        sm_registers = triton.runtime.driver.active.utils.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device()
        )["max_num_regs"]
        warps = kernel.metadata.num_warps
        registers = -(-kernel.n_regs * 32 // 256) * 256 * warps  # allocated per warp in units of 256
        shared = kernel.metadata.shared + 1024  # the driver reserves 1 KB a program
        by_threads = sm.max_threads_per_multi_processor // (32 * warps)
        _RESIDENT[key] = max(
            1, min(sm_registers // registers, sm.shared_memory_per_multiprocessor // shared, by_threads)
        )
    return _RESIDENT[key]
