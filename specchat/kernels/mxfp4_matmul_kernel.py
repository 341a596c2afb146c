"""The Triton MXFP4 matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T for M up to MAX_M (decode, verification).

W comes in the kernel layout of kernels/mxfp4_layout.py (read its docstring first). Hopper has no FP4 tensor
cores, so the kernel computes y^T = W @ x^T on the bf16 tensor cores with W as the register operand: each
thread decodes its own words straight into the operand fragment (`_decode_bf16_asm`, inline PTX, sm_90).

A portable path (`fast=False`: integer decode to float32 and a float32 dot) serves float16/float32 activations
and runs under TRITON_INTERPRET=1, where tl.dot on bf16 and inline assembly are unavailable. M > MAX_M runs in
chunks of MAX_M rows. For small N, split-K spreads K over several programs; the last one to finish a tile sums
the partials (a per-tile counter, reset by that program), so one launch does all the work. The reference is
x @ dequantize_mxfp4(W)^T (kernels/mxfp4.py); tests/kernels/test_mxfp4_matmul_kernel.py holds them equal.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specchat.kernels.mxfp4 import BLOCK_SIZE
from specchat.kernels.mxfp4_layout import K_TILE, N_TILE, ROW_GROUP, WORD_ELEMS, Mxfp4Weight

MAX_M = 64  # activation rows per launch (decode and verification); more rows run in chunks
MAX_SPLIT_K = 16
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROW_GROUP = tl.constexpr(ROW_GROUP)
_TILE_WORDS = tl.constexpr(ROW_GROUP * K_TILE // WORD_ELEMS)  # int32 words per (row group, k-tile): 4 KB
_TILE_SCALES = tl.constexpr(ROW_GROUP * K_TILE // BLOCK_SIZE)  # scale bytes per (row group, k-tile)


# ----------------------------------------------------------------------------------------------------------
# Decode. Both paths read the same prepared words; mxfp4_layout.ELEMENT_BITS is the bit layout.


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
