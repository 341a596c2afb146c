"""MXFP4 weight x activation matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, for decode and verification.

The interchange format is `specchat.kernels.mxfp4`'s (codes uint8 [N, K/2], scales uint8 [N, K/32]).
`prepare_weight` turns it, once at load time, into an `Mxfp4Weight` that is the only resident copy:

- CPU: the plain codes and scales. `mxfp4_linear` dequantizes into a shared scratch buffer (`DequantScratch`)
  and calls F.linear, so no dequantized copy outlives the call.
- CUDA: a re-laid-out copy for the Triton kernel (below). Same bytes per weight (K padded to 128, N to 128).

The Triton kernel (Hopper has no FP4 tensor cores) computes y^T = W @ x^T on the tensor cores with W as the
register operand: each thread decodes its own slice of W straight into the bf16 operand fragment, so no
layout conversion or shared-memory round trip is spent on the weight. The load-time layout makes that work:

- Fragment order. In the MMA's A-operand layout, lane t (of 4 sharing a row) holds, in every 32 k of a row,
  k = 2t + {0, 1, 8, 9, 16, 17, 24, 25}. A row's 128-element k-tile is 16 words, [lane t][32-k chunk q], so a
  thread reads 16 contiguous bytes per row and tile; the 64 rows of a row group are stored next to each
  other per k-tile (4 KB, scales likewise), so every load of a program step is one contiguous block.
- Bit order. Each 32-bit word holds those 8 elements as four bf16x2 pairs (k, k+1), with bits placed so that
  pair j comes out as (word << 3j) & 0x81C081C0 for j < 3 (sign -> bit 15/31, exponent and mantissa
  -> bits 8..6 / 24..22) and pair 3 with three shifts. The 16 bits are the E2M1 value times 2^-126 as a bf16
  (a subnormal for exponent 0), so one bf16x2 multiply by 2^126 * 2^(s - 127) both fixes the bias and
  applies the block scale: ~17 integer/half instructions per 8 weights, the block scale once per word.
- Range. The prepared scale byte is that multiplier's bf16 exponent, s + 126 - c, so the kernel only
  multiplies it by 0x00800080 (0xFF stays NaN). c = 0 unless some block scale exceeds 2 (s > 128): then
  c = max(s) - 128, the kernel multiplies by 2^(s - 1 - c) and the output by 2^c, and blocks more than
  2^125 below the largest of their weight are flushed to zero (documented; never seen in real weights).

A portable path (`fast=False`: integer decode to float32 and a float32 dot) serves float16/float32 activations
and runs under TRITON_INTERPRET=1, where tl.dot on bf16 and inline assembly are unavailable. M > MAX_M runs in
chunks of MAX_M rows. For small N, split-K spreads K over several programs; the last one to finish a tile sums
the partials (a per-tile counter, reset by that program), so one launch does all the work.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specchat.kernels.mxfp4 import (
    BLOCK_SIZE,
    E8M0_NAN,
    e2m1_to_float,
    mxfp4_storage_shapes,
    scales_to_float,
    unpack_nibbles,
)

MAX_M = 64  # activation rows per launch (decode and verification); more rows run in chunks
WORD_ELEMS = 8  # E2M1 elements per prepared int32 word
K_TILE = 128  # k per prepared tile: 4 lanes x 4 words x 8 elements; K is padded to this
N_TILE = 128  # prepared rows are padded to a multiple of this (the largest BLOCK_N)
ROW_GROUP = 64  # rows per group: the kernel layout stores each (row group, k-tile) contiguously
_ROW_GROUP = tl.constexpr(ROW_GROUP)
_TILE_WORDS = tl.constexpr(ROW_GROUP * K_TILE // WORD_ELEMS)  # int32 words per (row group, k-tile): 4 KB
_TILE_SCALES = tl.constexpr(ROW_GROUP * K_TILE // BLOCK_SIZE)  # scale bytes per (row group, k-tile)
MAX_SPLIT_K = 16
BF16_SCALE_LIMIT = 128  # largest scale code whose multiplier 2^(s - 1) is a finite bf16
KERNEL_SCALE_BIAS = 126  # prepared scale byte = s + 126 - c: the bf16 exponent field of 2^(s - 1 - c)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Bit position, in the prepared word, of (mantissa, exponent bit 0, exponent bit 1, sign) of each of the
# 8 elements; element 2j is the low and 2j+1 the high half of bf16x2 pair j. Pairs 0-2: (w << 3j) & MASK.
_PAIR3_LO = (10, 11, 13, 14)  # the leftover bits; pair 3 is reassembled with three shifts
_ELEMENT_BITS = tuple(
    tuple(b + 16 * half for b in ((6 - 3 * j, 7 - 3 * j, 8 - 3 * j, 15 - 3 * j) if j < 3 else _PAIR3_LO))
    for j in range(4)
    for half in (0, 1)
)


@dataclass(slots=True)
class Mxfp4Weight:
    """A [N, K] MXFP4 weight in the layout its device's matmul reads; build with `prepare_weight`."""

    n: int
    k: int
    codes: torch.Tensor  # plain: uint8 [N, Kp/2]; kernel: int32 words [Np/64, Kt/128, 64 rows, 16]
    scales: torch.Tensor  # plain: uint8 E8M0 [N, Kp/32]; kernel: uint8 s + 126 - c [Np/64, Kt/128, 64, 4]
    prepared: bool  # True: the kernel layout (K padded to K_TILE, N to N_TILE)
    exp_offset: int = 0  # c: the kernel scales blocks by 2^(s - 127 - c) and the output by 2^c
    has_nan: bool = False  # some scale is 0xFF (NaN block)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel()


def prepare_weight(
    codes: torch.Tensor, scales: torch.Tensor, k: int | None = None, layout: str = "auto"
) -> Mxfp4Weight:
    """Interchange (codes [N, Kp/2], scales [N, Kp/32]) -> Mxfp4Weight for the device they sit on.

    layout: "auto" (kernel layout on CUDA, plain on CPU), "kernel" or "plain".
    """
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8 and codes.dim() == 2, (codes, scales)
    n, kp = codes.shape[0], codes.shape[1] * 2
    assert scales.shape == (n, kp // BLOCK_SIZE), (codes.shape, scales.shape)
    k = kp if k is None else k
    assert 0 < k <= kp and kp - k < BLOCK_SIZE, (k, kp)
    if layout == "auto":
        layout = "kernel" if codes.is_cuda else "plain"
    if layout == "plain":
        return Mxfp4Weight(n, k, codes.contiguous(), scales.contiguous(), prepared=False)
    assert layout == "kernel", layout
    return _prepare_kernel_layout(codes, scales, n, k)


def _prepare_kernel_layout(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> Mxfp4Weight:
    kt = triton.cdiv(k, K_TILE) * K_TILE
    np_ = triton.cdiv(n, N_TILE) * N_TILE
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(n, -1)  # [N, Kp]
    nibbles = F.pad(nibbles, (0, kt - nibbles.shape[1], 0, np_ - n))  # [Np, Kt]
    scales = F.pad(scales, (0, kt // BLOCK_SIZE - scales.shape[1], 0, np_ - n))  # [Np, Kt/32]

    valid = scales != E8M0_NAN
    has_nan = not bool(valid.all())
    s_max = int(scales[valid].max()) if bool(valid.any()) else 0
    exp_offset = max(0, s_max - BF16_SCALE_LIMIT)
    biased = scales.int() + (KERNEL_SCALE_BIAS - exp_offset)  # see the module docstring: Range
    flush = valid & (biased < 1)
    nibbles = torch.where(flush.repeat_interleave(BLOCK_SIZE, dim=1), torch.zeros_like(nibbles), nibbles)
    kernel_scales = torch.where(valid, biased.clamp(min=1), E8M0_NAN).to(torch.uint8)

    # [Np, Kt] -> [Np, tile, chunk q, r, lane t, c] with k = 128 tile + 32 q + 8 r + 2 t + c
    el = nibbles.reshape(np_, kt // K_TILE, 4, 4, 4, 2)
    el = el.permute(0, 1, 4, 2, 3, 5).reshape(np_, kt // K_TILE, 4, 4, WORD_ELEMS)  # [.., t, q, e]
    el = el.to(torch.int32)
    word = torch.zeros(el.shape[:-1], dtype=torch.int32, device=el.device)
    for e, bits in enumerate(_ELEMENT_BITS):
        for field, position in enumerate(bits):  # mantissa, exp0, exp1, sign = nibble bits 0..3
            word |= ((el[..., e] >> field) & 1) << position  # bit 31 wraps to the sign, as intended
    words = word.reshape(np_, kt // WORD_ELEMS)  # [Np, Kt/8]
    return Mxfp4Weight(n, k, _tile_major(words, 16), _tile_major(kernel_scales, 4), True, exp_offset, has_nan)


def _tile_major(rows: torch.Tensor, per_tile: int) -> torch.Tensor:
    """[Np, tiles * per_tile] -> [Np/64, tiles, 64, per_tile]: one (row group, k-tile) is contiguous."""
    np_, tiles = rows.shape[0], rows.shape[1] // per_tile
    return rows.reshape(np_ // ROW_GROUP, ROW_GROUP, tiles, per_tile).permute(0, 2, 1, 3).contiguous()


def _row_major(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `_tile_major`."""
    groups, num_tiles, rows, per_tile = tiles.shape
    return tiles.permute(0, 2, 1, 3).reshape(groups * rows, num_tiles * per_tile)


def unprepare_weight(weight: Mxfp4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Mxfp4Weight -> interchange (codes [N, Kp/2], scales [N, Kp/32]), e.g. for saving a checkpoint."""
    codes_shape, scales_shape = mxfp4_storage_shapes((weight.n, weight.k))
    if not weight.prepared:
        return weight.codes, weight.scales
    words = _row_major(weight.codes)  # [Np, Kt/8] int32
    np_, kt = words.shape[0], words.shape[1] * WORD_ELEMS
    words = words.reshape(np_, kt // K_TILE, 4, 4)  # [Np, tile, t, q]
    el = torch.zeros((*words.shape, WORD_ELEMS), dtype=torch.int32, device=words.device)
    for e, bits in enumerate(_ELEMENT_BITS):
        for field, position in enumerate(bits):
            el[..., e] |= ((words >> position) & 1) << field
    el = el.reshape(np_, kt // K_TILE, 4, 4, 4, 2).permute(0, 1, 3, 4, 2, 5).reshape(np_, kt)
    el = el[: weight.n, : codes_shape[1] * 2].to(torch.uint8)
    codes = el[:, 0::2] | (el[:, 1::2] << 4)
    kernel_scales = _row_major(weight.scales)[: weight.n, : scales_shape[1]].int()  # flushed blocks: zero codes
    scales = kernel_scales - (KERNEL_SCALE_BIAS - weight.exp_offset)
    scales = torch.where(kernel_scales == E8M0_NAN, E8M0_NAN, scales).to(torch.uint8)
    return codes.contiguous(), scales.contiguous()


# ----------------------------------------------------------------------------------------------------------
# Decode. Both paths read the same prepared words; see _ELEMENT_BITS for the bit layout.


@triton.jit
def _word_pairs(words):
    """int32 words -> the raw bits of their four bf16x2 pairs (uint32): E2M1 value * 2^-126 as bf16."""
    w = words.to(tl.uint32, bitcast=True)
    p0 = w & 0x81C081C0
    p1 = (w << 3) & 0x81C081C0
    p2 = (w << 6) & 0x81C081C0
    p3 = ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)
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
def _decode_float(words, scales, HAS_NAN: tl.constexpr):
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


_ASM_DECODE_TEMPLATE = """{
.reg .pred nan;
.reg .b32 m, p0, p1, p2, p3, a, b, c;
mul.lo.u32 m, $9, 0x00800080;
%s
and.b32 p0, $8, 0x81C081C0;
shl.b32 a, $8, 3;
and.b32 p1, a, 0x81C081C0;
shl.b32 a, $8, 6;
and.b32 p2, a, 0x81C081C0;
shr.b32 a, $8, 4;
shr.b32 b, $8, 5;
shl.b32 c, $8, 1;
and.b32 a, a, 0x00C000C0;
and.b32 b, b, 0x01000100;
and.b32 c, c, 0x80008000;
or.b32 a, a, b;
or.b32 p3, a, c;
mul.rn.bf16x2 p0, p0, m;
mul.rn.bf16x2 p1, p1, m;
mul.rn.bf16x2 p2, p2, m;
mul.rn.bf16x2 p3, p3, m;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""
_ASM_DECODE = tl.constexpr(_ASM_DECODE_TEMPLATE % "")
_ASM_DECODE_NAN = tl.constexpr(_ASM_DECODE_TEMPLATE % "setp.eq.u32 nan, $9, 0xFF;\nselp.b32 m, 0x7FC07FC0, m, nan;")


@triton.jit
def _decode_bf16_asm(words, scales, HAS_NAN: tl.constexpr):
    """Fast decode (sm_90), the same math as _word_pairs: word, scale code -> 8 bf16 elements e0..e7.

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
def _weight_tile(
    w_ptr,
    s_ptr,
    word_offs,
    scale_offs,
    BLOCK_N: tl.constexpr,
    Q: tl.constexpr,
    FAST: tl.constexpr,
    HAS_NAN: tl.constexpr,
):
    """One iteration's weights -> [BLOCK_N, 32 Q] operand (bf16 if FAST else float32), k in natural order."""
    words = tl.load(w_ptr + word_offs).reshape(BLOCK_N, Q // 4, 4, 4)  # [BN, tile, lane t, q4]
    words = tl.trans(words, (0, 1, 3, 2)).reshape(BLOCK_N, Q, 4)  # [BN, chunk q, lane t]
    scales = tl.load(s_ptr + scale_offs).to(tl.int32).reshape(BLOCK_N, Q)  # [BN, Q]
    scales = tl.broadcast_to(scales[:, :, None], (BLOCK_N, Q, 4))  # [BN, Q, T]
    if FAST:
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_bf16_asm(words, scales, HAS_NAN)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_float(words, scales, HAS_NAN)
    # element e = 4x + 2y + z of lane t in chunk q sits at k = 32 q + 8 r + 2 t + c, r = 2x + y, c = z
    w = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    w = tl.reshape(w, (BLOCK_N, Q, 4, 4, 2))  # [BN, q, t, r, c]
    return tl.trans(w, (0, 1, 3, 2, 4)).reshape(BLOCK_N, Q * 32)  # [BN, BK]


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,  # [M, Kt] activations (zero-padded to the weight's padded K)
    w_ptr,  # [Np/64, Kt/128, 64, 16] int32 prepared words
    s_ptr,  # [Np/64, Kt/128, 64, 4] uint8 kernel scale bytes
    y_ptr,  # [M, N] output, x's dtype
    partial_ptr,  # [split_k, Np, BLOCK_M] float32 split-K partials (unused when split_k == 1)
    counter_ptr,  # [Np / BLOCK_N] int32 split-K arrivals, zero between launches
    M,
    N,
    num_k_tiles,
    stride_xm,
    stride_ym,
    out_scale,  # 2^c
    split_k,  # programs along K; the last to finish a tile sums the partials
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,  # K_TILEs per iteration
    FAST: tl.constexpr,
    HAS_NAN: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    Q: tl.constexpr = 4 * TILES  # 32-element chunks per iteration
    BLOCK_K: tl.constexpr = 32 * Q
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # one iteration reads TILES (row group, k-tile) blocks per 64 rows, each contiguous: [BN, tile, 16 words]
    # with lane t's 4 words at 4t (one 16-byte load), and [BN, tile, 4] scale bytes
    group, row = offs_n // _ROW_GROUP, offs_n % _ROW_GROUP
    tile = tl.arange(0, TILES)[None, :, None]
    word_offs = (group * num_k_tiles * _TILE_WORDS + row * 16)[:, None, None] + tile * _TILE_WORDS
    word_offs += tl.arange(0, 16)[None, None, :]
    scale_offs = (group * num_k_tiles * _TILE_SCALES + row * 4)[:, None, None] + tile * _TILE_SCALES
    scale_offs += tl.arange(0, 4)[None, None, :]

    iterations = tl.cdiv(num_k_tiles, TILES)
    per_split = tl.cdiv(iterations, split_k)
    start = pid_k * per_split
    stop = tl.minimum(start + per_split, iterations)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    for it in range(start, stop):
        w = _weight_tile(
            w_ptr,
            s_ptr,
            word_offs + it * TILES * _TILE_WORDS,
            scale_offs + it * TILES * _TILE_SCALES,
            BLOCK_N,
            Q,
            FAST,
            HAS_NAN,
        )  # [BN, BK]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (it * BLOCK_K + offs_k)[:, None]
        xt = tl.load(x_ptrs, mask=offs_m[None, :] < M, other=0.0)  # [BK, BM]
        if not FAST:
            xt = xt.to(tl.float32)  # the portable path multiplies and sums in float32
        acc = tl.dot(w, xt, acc, input_precision="ieee")

    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    if split_k == 1:
        tl.store(y_ptrs, (acc * out_scale).to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # Publish this split's partial; the last split to arrive at the tile sums all of them.
        rows = tl.num_programs(0) * BLOCK_N
        partial_offs = offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(partial_ptr + pid_k * rows * BLOCK_M + partial_offs, acc)
        tl.debug_barrier()  # every thread's partial is written before the (release) arrival below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for split in range(split_k):
                total += tl.load(partial_ptr + split * rows * BLOCK_M + partial_offs, cache_modifier=".cg")
            tl.store(y_ptrs, (total * out_scale).to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch


# ----------------------------------------------------------------------------------------------------------
# Launch


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """Launch parameters of `_mxfp4_matmul_kernel` (BLOCK_M follows M)."""

    block_n: int = 64
    tiles: int = 2  # K_TILEs per iteration
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        assert self.block_n in (64, 128) and N_TILE % self.block_n == 0, self
        assert self.tiles in (1, 2, 4) and 1 <= self.split_k <= MAX_SPLIT_K, self


WIDE_N = 16384  # from here on 128-row programs are faster (fewer, longer programs; 2 row groups each)
SPLIT_K_WAVES = 3.0  # programs per SM that split-K aims for (half that for M > 32)
SPLIT_K_MIN_TILES = 28  # long K also splits while each split keeps this many k-tiles


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_config(m: int, weight: Mxfp4Weight) -> MatmulConfig:
    """The launch for M rows of this weight, from the H200 sweep (benchmarks/mxfp4_matmul.py --sweep).

    128-row programs for wide weights, 64 otherwise. Split-K doubles while the programs stay within
    SPLIT_K_WAVES x SMs, or while each split keeps SPLIT_K_MIN_TILES k-tiles, and each split iterates twice.
    """
    k_tiles = weight.codes.shape[1]
    block_n = 128 if weight.n >= WIDE_N else 64
    tiles = 2 if k_tiles % 2 == 0 else 1
    programs = weight.codes.shape[0] * ROW_GROUP // block_n
    target = SPLIT_K_WAVES * (1 if m <= 32 else 0.5) * _sm_count(weight.codes.device)
    split_k = 1
    while split_k * 2 <= MAX_SPLIT_K and k_tiles // (tiles * split_k * 2) >= 2:
        wide_enough = programs * split_k * 2 <= target or k_tiles // (split_k * 2) >= SPLIT_K_MIN_TILES
        if not wide_enough:
            break
        split_k *= 2
    return MatmulConfig(block_n=block_n, tiles=tiles, split_k=split_k)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else MAX_M


class _SplitKWorkspace:
    """Per-device float32 partials and zeroed arrival counters for split-K, grown on demand and reused."""

    def __init__(self) -> None:
        self._partials: dict[torch.device, torch.Tensor] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, partial_numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        partials = self._partials.get(device)
        if partials is None or partials.numel() < partial_numel:
            partials = self._partials[device] = torch.empty(partial_numel, dtype=torch.float32, device=device)
        counters = self._counters.get(device)
        if counters is None or counters.numel() < tiles:
            counters = self._counters[device] = torch.zeros(tiles, dtype=torch.int32, device=device)
        return partials, counters


_SPLIT_K_WORKSPACE = _SplitKWorkspace()


def mxfp4_matmul_triton(
    x: torch.Tensor, weight: Mxfp4Weight, config: MatmulConfig | None = None, fast: bool | None = None
) -> torch.Tensor:
    """x [M, K] @ dequant(weight)^T -> [M, N] in x's dtype, by the Triton kernel (CUDA, or the interpreter).

    fast: the inline-assembly bf16 path (default: on CUDA with bf16 x); otherwise the portable float32 path.
    Not thread-safe with itself across streams: split-K shares one workspace per device.
    """
    assert weight.prepared, "prepare_weight(..., layout='kernel') first"
    assert x.dim() == 2 and x.shape[1] == weight.k, (x.shape, weight.n, weight.k)
    assert x.dtype in ACTIVATION_DTYPES and x.stride(1) == 1, (x.dtype, x.stride())
    assert x.device == weight.codes.device, (x.device, weight.codes.device)
    if fast is None:
        fast = x.is_cuda and x.dtype == torch.bfloat16
    assert not fast or x.dtype == torch.bfloat16, "the fast path takes bf16 activations"
    m = x.shape[0]
    padded_k = weight.codes.shape[1] * K_TILE
    if padded_k != weight.k:  # K % K_TILE != 0: the kernel reads whole tiles of x
        x = F.pad(x, (0, padded_k - weight.k))
    y = torch.empty((m, weight.n), dtype=x.dtype, device=x.device)
    for row in range(0, m, MAX_M):
        rows = min(MAX_M, m - row)
        _launch(x[row : row + rows], weight, y[row : row + rows], config or choose_config(rows, weight), fast)
    return y


def _launch(x: torch.Tensor, weight: Mxfp4Weight, y: torch.Tensor, config: MatmulConfig, fast: bool) -> None:
    m = x.shape[0]
    block_m = _block_m(m)
    groups, num_k_tiles = weight.codes.shape[:2]
    rows_padded = groups * ROW_GROUP
    tiles = config.tiles
    while num_k_tiles % tiles:  # an iteration never reads past its row
        tiles //= 2
    grid = (rows_padded // config.block_n, config.split_k)
    partial_numel = config.split_k * rows_padded * block_m if config.split_k > 1 else 1
    partials, counters = _SPLIT_K_WORKSPACE.get(x.device, partial_numel, grid[0])
    _mxfp4_matmul_kernel[grid](
        x, weight.codes, weight.scales, y, partials, counters,
        m, weight.n, num_k_tiles,
        x.stride(0), y.stride(0),
        float(2.0**weight.exp_offset), config.split_k,
        BLOCK_M=block_m, BLOCK_N=config.block_n, TILES=tiles,
        FAST=fast, HAS_NAN=weight.has_nan, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# CPU: dequantize into a shared scratch buffer


class DequantScratch:
    """One growable buffer per (device, dtype) that a dequantized weight borrows for one matmul.

    A whole model shares one instance (layers run one after another), so the resident weights stay packed and
    the extra memory is the largest single layer. Not thread-safe.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get((device, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


DEFAULT_SCRATCH = DequantScratch()


DEQUANT_CHUNK_ELEMS = 1 << 20  # rows are dequantized in chunks of about this many elements (bounded temporaries)


@functools.cache
def _byte_pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the (low, high) nibble E2M1 values of every code byte."""
    byte = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return e2m1_to_float(unpack_nibbles(byte[:, None]))


def dequantize_weight_into(weight: Mxfp4Weight, out: torch.Tensor) -> torch.Tensor:
    """Plain-layout weight -> out [N, K] (out's dtype): `dequantize_mxfp4`'s values, in row chunks."""
    assert not weight.prepared and out.shape == (weight.n, weight.k), (out.shape, weight.n, weight.k)
    table = _byte_pair_table(out.device)
    kp = weight.codes.shape[1] * 2
    rows = max(1, DEQUANT_CHUNK_ELEMS // kp)
    for r0 in range(0, weight.n, rows):
        codes = weight.codes[r0 : r0 + rows]  # [r, Kp/2]
        values = torch.index_select(table, 0, codes.flatten().to(torch.int32))  # [r * Kp/2, 2]
        values = values.view(-1, weight.scales.shape[1], BLOCK_SIZE)  # [r, Kp/32, 32]
        values *= scales_to_float(weight.scales[r0 : r0 + rows])[..., None]
        out[r0 : r0 + rows] = values.view(-1, kp)[:, : weight.k]
    return out


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
    dense = (scratch or DEFAULT_SCRATCH).get((weight.n, weight.k), x.dtype, x.device)
    return F.linear(x, dequantize_weight_into(weight, dense), bias)


# ----------------------------------------------------------------------------------------------------------
# On-GPU quantization at load time: bit-for-bit the reference `quantize_mxfp4` for rules "ocp" and "roundup".


@triton.jit
def _quantize_kernel(
    x_ptr,  # [R, K] float
    codes_ptr,  # [R, Kp/2] uint8
    scales_ptr,  # [R, Kp/32] uint8
    R,
    K,
    num_blocks,  # Kp / 32
    stride_xr,
    stride_cr,
    stride_sr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,  # 32-element blocks per program
    ROUNDUP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    blocks = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    k = blocks[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # [1, BB, 32]
    in_rows = rows[:, None, None] < R
    x = tl.load(x_ptr + rows[:, None, None] * stride_xr + k, mask=in_rows & (k < K), other=0.0)
    x = x.to(tl.float32)  # [BR, BB, 32]
    bits = x.to(tl.int32, bitcast=True)
    nonfinite = tl.max((((bits >> 23) & 0xFF) == 0xFF).to(tl.int32), axis=2) != 0  # [BR, BB]: NaN or Inf
    amax = tl.max(tl.abs(x), axis=2)
    # floor(log2(amax)) - 2 from the exponent field; zero and subnormal amax clamp to -127 like the reference
    exponent = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 2, -127)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^-e, e <= 125 for finite input
    if ROUNDUP:  # amax / 2^e in [4, 8): above 6, one more (never clips)
        exponent += (amax * inverse > 6.0).to(tl.int32)
        inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    v = tl.abs(x * inverse[:, :, None])
    # round to nearest even on the E2M1 grid, saturating at 6 (see mxfp4.E2M1_MIDPOINTS)
    code = (
        (v > 0.25).to(tl.int32)
        + (v >= 0.75).to(tl.int32)
        + (v > 1.25).to(tl.int32)
        + (v >= 1.75).to(tl.int32)
        + (v > 2.5).to(tl.int32)
        + (v >= 3.5).to(tl.int32)
        + (v > 5.0).to(tl.int32)
    )
    code = code | ((bits >> 28) & 0x8)  # the float's sign bit -> E2M1 bit 3
    code = tl.where(nonfinite[:, :, None], 0, code)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_R, BLOCK_B, 16, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)  # [BR, BB, 16]
    in_blocks = (rows[:, None] < R) & (blocks[None, :] < num_blocks)  # [BR, BB]
    byte = blocks[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    tl.store(codes_ptr + rows[:, None, None] * stride_cr + byte, packed, mask=in_blocks[:, :, None])
    scale = tl.where(nonfinite, 0xFF, exponent + 127).to(tl.uint8)
    tl.store(scales_ptr + rows[:, None] * stride_sr + blocks[None, :], scale, mask=in_blocks)


def quantize_mxfp4_triton(x: torch.Tensor, rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_mxfp4` (rules "ocp", "roundup") by a Triton kernel: same codes and scales, bit for bit."""
    assert rule in ("ocp", "roundup"), rule
    assert x.dtype in ACTIVATION_DTYPES and x.dim() >= 1, (x.dtype, x.shape)
    *lead, k = x.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    codes_shape, scales_shape = mxfp4_storage_shapes((x2.shape[0], k))
    codes = torch.empty(codes_shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(scales_shape, dtype=torch.uint8, device=x.device)
    block_r, block_b = 16, 8
    grid = (triton.cdiv(x2.shape[0], block_r), triton.cdiv(scales_shape[1], block_b))
    _quantize_kernel[grid](
        x2, codes, scales, x2.shape[0], k, scales_shape[1], x2.stride(0), codes.stride(0), scales.stride(0),
        BLOCK_R=block_r, BLOCK_B=block_b, ROUNDUP=rule == "roundup",
    )  # fmt: skip
    return codes.reshape(*lead, codes_shape[1]), scales.reshape(*lead, scales_shape[1])
