"""The Triton MXFP4 matmul: y[M, N] = x[M, K] @ dequant(W)[N, K]^T for any M (decode, verification, prefill).

W comes in the kernel layout of kernels/mxfp4_layout.py (read its docstring first). Hopper has no FP4 tensor
cores, so the kernel computes y^T = W @ x^T on the bf16 tensor cores with W as the register operand: each
thread decodes its own words straight into the operand fragment (`decode_bf16_asm`, kernels/mxfp4_decode.py).
One kernel serves both regimes:

- GEMV (M <= 16: decode steps, short verification): one 16-row tile of x; the weight read is all that costs.
  For small N, split-K spreads K over several programs; the last one to finish a tile sums the partials (a
  per-tile counter, reset by that program), so one launch does all the work.
- Matmul (M = 17..512 and beyond: many sessions' verification, prefill chunks): a grid over M tiles, M tiles
  of one weight tile next to each other in launch order so W is read from DRAM once and from the L2 for the
  others. An M tile is BLOCK_M rows (a power of two, one MMA) plus, optionally, EXTRA_M more that the program
  multiplies by the same decoded weights (a second MMA): 160 verification rows run as 128 + 32 or 2 x (64 + 16)
  instead of three 64-row tiles that each decode the weights (`_reuse_config`).

A portable path (`fast=False`: integer decode to float32 and a float32 dot) serves float16/float32 activations
and runs under TRITON_INTERPRET=1, where tl.dot on bf16 and inline assembly are unavailable. The reference is
x @ dequantize_mxfp4(W)^T (kernels/mxfp4.py); tests/kernels/test_mxfp4_matmul_kernel.py holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton
from specchat.kernels.device import sm_count
from specchat.kernels.mxfp4 import BLOCK_SIZE
from specchat.kernels.mxfp4_decode import decode_bf16_asm, decode_float, word_bytes
from specchat.kernels.mxfp4_layout import K_TILE, N_TILE, ROW_GROUP, WORD_ELEMS, Mxfp4Weight
from specchat.kernels.mxfp4_matmul import ACTIVATION_DTYPES

BLOCK_MS = (8, 16, 32, 64, 128, 256)  # activation rows per program (the MMA's n)
MIN_BLOCK_M, MAX_BLOCK_M = 16, 64  # the range choose_config picks from (8, 128, 256 measured no better)
SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipeline buffers per program (the H200 has 227 KB per SM)
MAX_SPLIT_K = 32  # what a launch may ask for (benchmarks sweep up to one k-step per program)
CHOSEN_MAX_SPLIT_K = 16  # what choose_config picks from (the H200 sweeps' range)
_ROW_GROUP = tl.constexpr(ROW_GROUP)
_TILE_WORDS = tl.constexpr(ROW_GROUP * K_TILE // WORD_ELEMS)  # int32 words per (row group, k-tile): 4 KB


@triton.jit
def tile_offsets(offs_n, num_k_tiles, TILES: tl.constexpr):
    """Where rows offs_n [BN] of a kernel-layout weight keep their first TILES k-tiles (add it * TILES * 4 KB of
    words, it * TILES * 64 scale words, for iteration it): each (row group, k-tile) block is contiguous, so an
    iteration reads [BN, tile, 16 words] with lane t's 4 words at 4t (one 16-byte load), and [BN, tile] scale words
    (one int32 per row and k-tile: a 4-byte load that cp.async copies, 1- or 2-byte ones it does not).
    Returns each row's first word of each tile [BN, TILES, 1] (what an L2 prefetch touches), the words
    [BN, TILES, 16] and the scale words [BN, TILES]."""
    group, row = offs_n // _ROW_GROUP, offs_n % _ROW_GROUP
    tile = tl.arange(0, TILES)[None, :, None]
    row_offs = (group * num_k_tiles * _TILE_WORDS + row * 16)[:, None, None] + tile * _TILE_WORDS
    word_offs = row_offs + tl.arange(0, 16)[None, None, :]
    scale_offs = (group * num_k_tiles * _ROW_GROUP + row)[:, None] + tl.arange(0, TILES)[None, :] * _ROW_GROUP
    return row_offs, word_offs, scale_offs


@triton.jit
def load_tiles(w_ptr, s_ptr, word_offs, scale_offs, it, TILES: tl.constexpr):
    """Iteration `it`'s raw words [BN, TILES, 16] and scale words [BN, TILES] (offsets from `tile_offsets`)."""
    words = tl.load(w_ptr + word_offs + it * TILES * _TILE_WORDS)
    scales = tl.load(s_ptr + scale_offs + it * TILES * _ROW_GROUP)
    return words, scales


@triton.jit
def _load_step(w_ptr, s_ptr, x_ptr, word_offs, scale_offs, x_offs, x_mask, it, TILES: tl.constexpr):
    """Iteration `it`'s raw words [BN, TILES, 16], scale words [BN, TILES] and x^T tile [BK, BM]."""
    words, scales = load_tiles(w_ptr, s_ptr, word_offs, scale_offs, it, TILES)
    xt = tl.load(x_ptr + x_offs + it * TILES * 128, mask=x_mask, other=0.0)
    return words, scales, xt


@triton.jit
def weight_tile(words, scales, BLOCK_N: tl.constexpr, Q: tl.constexpr, FAST: tl.constexpr, HAS_NAN: tl.constexpr):
    """One iteration's words and scale words (a row's 4 scale bytes of a k-tile in one int32, little-endian)
    -> [BLOCK_N, 32 Q] operand (bf16 if FAST else float32)."""
    words = words.reshape(BLOCK_N, Q // 4, 4, 4)  # [BN, tile, lane t, q4]
    words = tl.trans(words, (0, 1, 3, 2)).reshape(BLOCK_N, Q, 4)  # [BN, chunk q, lane t]
    scales = word_bytes(scales).reshape(BLOCK_N, Q)  # [BN, tile, 2, 2] -> [BN, Q]
    scales = tl.broadcast_to(scales[:, :, None], (BLOCK_N, Q, 4))  # [BN, Q, T]
    if FAST:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_bf16_asm(words, scales, HAS_NAN)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_float(words, scales, HAS_NAN)
    # element e = 4x + 2y + z of lane t in chunk q sits at k = 32 q + 8 r + 2 t + c, r = 2x + y, c = z
    w = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    w = tl.reshape(w, (BLOCK_N, Q, 4, 4, 2))  # [BN, q, t, r, c]
    return tl.trans(w, (0, 1, 3, 2, 4)).reshape(BLOCK_N, Q * 32)  # [BN, BK]


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,  # [M, Kt] activations (zero-padded to the weight's padded K)
    w_ptr,  # [Np/64, Kt/128, 64, 16] int32 prepared words
    s_ptr,  # [Np/64, Kt/128, 64] int32: each the 4 uint8 kernel scale bytes of a row's k-tile
    y_ptr,  # [M, N] output, x's dtype
    partial_ptr,  # [split_k, m_tiles, Np, BLOCK_M + EXTRA_M] float32 split-K partials (unused when split_k == 1)
    counter_ptr,  # [m_tiles * Np / BLOCK_N] int32 split-K arrivals, zero between launches
    M,
    N,
    num_k_tiles,
    m_tiles,
    stride_xm,
    stride_ym,
    out_scale,  # 2^c
    split_k,  # programs along K; the last to finish a tile sums the partials
    BLOCK_M: tl.constexpr,
    EXTRA_M: tl.constexpr,  # 0, or rows of a second activation tile after BLOCK_M's that reuses the decoded weights
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,  # K_TILEs per iteration
    FAST: tl.constexpr,
    HAS_NAN: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    PREFETCH: tl.constexpr,  # with PDL: the program's first iterations of weights to prefetch into the L2
):
    pid = tl.program_id(0)  # M tile fastest: the M tiles of one weight tile run together and share it in L2
    pid_k = tl.program_id(1)
    pid_m, pid_n = pid % m_tiles, pid // m_tiles
    Q: tl.constexpr = 4 * TILES  # 32-element chunks per iteration
    BLOCK_K: tl.constexpr = 32 * Q
    TILE_M: tl.constexpr = BLOCK_M + EXTRA_M  # activation rows per program
    EXTRA_COLS: tl.constexpr = EXTRA_M if EXTRA_M > 0 else 16  # the second tile's shape (unused when EXTRA_M == 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * TILE_M + tl.arange(0, BLOCK_M)
    offs_e = pid_m * TILE_M + BLOCK_M + tl.arange(0, EXTRA_COLS)
    offs_k = tl.arange(0, BLOCK_K)
    row_offs, word_offs, scale_offs = tile_offsets(offs_n, num_k_tiles, TILES)
    x_offs = offs_m[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]: x^T
    x_mask = offs_m[None, :] < M
    xe_offs = offs_e[None, :] * stride_xm + offs_k[:, None]  # [BK, EXTRA]: the second tile's x^T
    xe_mask = offs_e[None, :] < M

    iterations = tl.cdiv(num_k_tiles, TILES)
    per_split = tl.cdiv(iterations, split_k)
    start = pid_k * per_split
    stop = tl.minimum(start + per_split, iterations)
    if PDL:  # the weights are constant: start their first iterations towards the L2 while the kernel before runs
        for i in tl.static_range(PREFETCH):  # a row's 64 bytes of a tile, its scale word: each line twice or more
            it = tl.minimum(start + i, iterations - 1)
            pdl_triton.prefetch_l2(w_ptr + row_offs + it * TILES * _TILE_WORDS)
            pdl_triton.prefetch_l2(s_ptr + scale_offs + it * TILES * _ROW_GROUP)
    pdl_triton.wait(PDL)  # x, the output and the split-K workspace are other kernels' too: nothing of them before this
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    acc_e = tl.zeros([BLOCK_N, EXTRA_COLS], dtype=tl.float32)  # the second tile's
    for it in range(start, stop):
        words, scales, xt = _load_step(w_ptr, s_ptr, x_ptr, word_offs, scale_offs, x_offs, x_mask, it, TILES)
        w = weight_tile(words, scales, BLOCK_N, Q, FAST, HAS_NAN)  # [BN, BK]
        if not FAST:
            xt = xt.to(tl.float32)  # the portable path multiplies and sums in float32
        acc = tl.dot(w, xt, acc, input_precision="ieee")
        if EXTRA_M > 0:  # the same decoded weights against the next rows (one decode for TILE_M rows)
            xe = tl.load(x_ptr + xe_offs + it * BLOCK_K, mask=xe_mask, other=0.0)
            if not FAST:
                xe = xe.to(tl.float32)
            acc_e = tl.dot(w, xe, acc_e, input_precision="ieee")
    # the next kernel (a short one) launches now, not earlier: launched at the start, the kernels after it would
    # launch too and park, and their weight prefetches would be evicted by this one's stream before they run
    pdl_triton.launch_dependents(PDL)

    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_mask = (offs_m[None, :] < M) & (offs_n[:, None] < N)
    ye_ptrs = y_ptr + offs_e[None, :] * stride_ym + offs_n[:, None]
    ye_mask = (offs_e[None, :] < M) & (offs_n[:, None] < N)
    if split_k == 1:
        tl.store(y_ptrs, (acc * out_scale).to(y_ptr.dtype.element_ty), mask=y_mask)
        if EXTRA_M > 0:
            tl.store(ye_ptrs, (acc_e * out_scale).to(y_ptr.dtype.element_ty), mask=ye_mask)
    else:
        # Publish this split's partial; the last split to arrive at the tile sums all of them.
        rows = tl.num_programs(0) // m_tiles * BLOCK_N
        partial_offs = (pid_m * rows + offs_n[:, None]) * TILE_M + tl.arange(0, BLOCK_M)[None, :]
        partial_e = (pid_m * rows + offs_n[:, None]) * TILE_M + BLOCK_M + tl.arange(0, EXTRA_COLS)[None, :]
        split_stride = m_tiles * rows * TILE_M
        tl.store(partial_ptr + pid_k * split_stride + partial_offs, acc)
        if EXTRA_M > 0:
            tl.store(partial_ptr + pid_k * split_stride + partial_e, acc_e)
        tl.debug_barrier()  # every thread's partial is written before the (release) arrival below
        arrived = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for split in range(split_k):
                total += tl.load(partial_ptr + split * split_stride + partial_offs, cache_modifier=".cg")
            tl.store(y_ptrs, (total * out_scale).to(y_ptr.dtype.element_ty), mask=y_mask)
            if EXTRA_M > 0:
                total_e = tl.zeros([BLOCK_N, EXTRA_COLS], dtype=tl.float32)
                for split in range(split_k):
                    total_e += tl.load(partial_ptr + split * split_stride + partial_e, cache_modifier=".cg")
                tl.store(ye_ptrs, (total_e * out_scale).to(y_ptr.dtype.element_ty), mask=ye_mask)
            tl.atomic_xchg(counter_ptr + pid, 0)  # ready for the next launch


# ----------------------------------------------------------------------------------------------------------
# Launch


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """Launch parameters of `_mxfp4_matmul_kernel`; block_m 0 follows M (`default_block_m`). extra_m > 0: each
    program also multiplies the next extra_m activation rows by the weights it decoded (M tiles of block_m +
    extra_m rows, e.g. 128 + 32 for a 160-row verification)."""

    block_n: int = 64
    tiles: int = 2  # K_TILEs per iteration
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 0
    extra_m: int = 0

    def __post_init__(self) -> None:
        assert self.block_n in (64, 128) and N_TILE % self.block_n == 0, self
        assert self.tiles in (1, 2, 4) and 1 <= self.split_k <= MAX_SPLIT_K, self
        assert self.block_m == 0 or self.block_m in BLOCK_MS, self
        assert self.extra_m == 0 or (self.block_m and self.extra_m in BLOCK_MS and self.extra_m >= 16), self


WIDE_N = 16384  # from here on 128-row programs are faster (fewer, longer programs; 2 row groups each)
SPLIT_K_WAVES = 3.0  # programs per SM that split-K aims for (half that for M > 32)
SPLIT_K_MIN_TILES = 28  # long K also splits while each split keeps this many k-tiles
LONG_K = 8192  # M > 64: weights this long along K take the wide weights' programs too
MIN_WARPGROUP_WAVES = 1.9  # M > 64: split-K until the programs make about two warpgroups per SM
MAX_REUSE_SPLIT_K = 4
PREFETCH_ITERATIONS = 2  # with PDL: weight iterations per program prefetched into the L2 before the wait


def default_block_m(m: int) -> int:
    """The smallest BLOCK_MS entry from MIN_BLOCK_M on that holds M rows, at most MAX_BLOCK_M (more: M tiles)."""
    return next((b for b in BLOCK_MS if MIN_BLOCK_M <= b <= MAX_BLOCK_M and m <= b), MAX_BLOCK_M)


def _pow2_at_least(value: int, least: int) -> int:
    return max(least, 1 << max(0, value - 1).bit_length())


def _reuse_config(m: int, weight: Mxfp4Weight) -> MatmulConfig | None:
    """M > 64 where programs that multiply their decoded weights by more rows measured faster (H200,
    `benchmarks/mxfp4_matmul.py --two-tile --sweep-ms 128,160,256`), else None.

    Wide or long-K weights: two warpgroups (128 weight rows) per program and 128 activation rows, plus a second
    tile of the rest up to M = 192 (160 = 128 + 32: each weight tile decoded once). Other weights from M = 129 to
    192: two programs per weight tile of 64 + the rest rows each (160 = 2 x (64 + 16)). One k-tile per step
    (the x tiles take the shared memory). Split-K (at most 4: the partials grow with M) until the programs make
    MIN_WARPGROUP_WAVES warpgroups per SM.
    """
    big = weight.n >= WIDE_N or weight.k >= LONG_K
    if m <= 2 * MAX_BLOCK_M:
        if not big:
            return None
        block_m, extra_m = 2 * MAX_BLOCK_M, 0
    elif m <= 3 * MAX_BLOCK_M:
        if big:
            block_m, extra_m = 2 * MAX_BLOCK_M, _pow2_at_least(m - 2 * MAX_BLOCK_M, MIN_BLOCK_M)
        else:
            block_m, extra_m = MAX_BLOCK_M, _pow2_at_least(-(-m // 2) - MAX_BLOCK_M, MIN_BLOCK_M)
    elif weight.k >= LONG_K:
        block_m, extra_m = 2 * MAX_BLOCK_M, 0
    else:
        return None
    block_n, warps = (128, 8) if big else (64, 4)
    k_tiles = weight.codes.shape[1]
    programs = weight.codes.shape[0] * ROW_GROUP // block_n * -(-m // (block_m + extra_m))
    warpgroups = programs * warps // 4
    split_k = 1
    while (
        warpgroups * split_k < MIN_WARPGROUP_WAVES * sm_count(weight.codes.device)
        and split_k < MAX_REUSE_SPLIT_K
        and k_tiles // (split_k * 2) >= 2
    ):
        split_k *= 2
    return MatmulConfig(block_n, 1, split_k, warps, 3, block_m, extra_m)


def choose_config(m: int, weight: Mxfp4Weight) -> MatmulConfig:
    """The launch for M rows of this weight, from the H200 sweeps (benchmarks/mxfp4_matmul.py --sweep-ms).

    Above M = 64, `_reuse_config`'s programs where they measured faster; otherwise M tiles of up to 64 rows
    (a plain 128-row tile pads 160 rows to 256, a 128 x 128 accumulator spills). Wide weights take 128-row
    programs up to M = 32, and above M = 64 two warpgroups of 64 rows each with one k-tile per step; everything
    else 64-row programs of one warpgroup. Split-K doubles while the
    programs stay within SPLIT_K_WAVES x SMs, or while each split keeps SPLIT_K_MIN_TILES k-tiles, and each
    split iterates twice.
    """
    if m > MAX_BLOCK_M and (config := _reuse_config(m, weight)) is not None:
        return config
    k_tiles = weight.codes.shape[1]
    wide = weight.n >= WIDE_N
    if wide and m <= 32:
        block_n, tiles, warps = 128, 2, 4
    elif wide and m > MAX_BLOCK_M:
        block_n, tiles, warps = 128, 1, 8
    else:
        block_n, tiles, warps = 64, 2, 4
    tiles = tiles if k_tiles % tiles == 0 else 1
    block_m = default_block_m(m)
    programs = weight.codes.shape[0] * ROW_GROUP // block_n * -(-m // block_m)
    target = SPLIT_K_WAVES * (1 if m <= 32 else 0.5) * sm_count(weight.codes.device)
    split_k = 1
    while split_k * 2 <= CHOSEN_MAX_SPLIT_K and k_tiles // (tiles * split_k * 2) >= 2:
        wide_enough = programs * split_k * 2 <= target or k_tiles // (split_k * 2) >= SPLIT_K_MIN_TILES
        if not wide_enough:
            break
        split_k *= 2
    return MatmulConfig(block_n=block_n, tiles=tiles, split_k=split_k, num_warps=warps, block_m=block_m)


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

    One launch for any M. fast: the inline-assembly bf16 path (default: on CUDA with bf16 x); otherwise the
    portable float32 path. Not thread-safe with itself across streams: split-K shares one workspace per device.
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
    if m:
        _launch(x, weight, y, config or choose_config(m, weight), fast)
    return y


def _launch(x: torch.Tensor, weight: Mxfp4Weight, y: torch.Tensor, config: MatmulConfig, fast: bool) -> None:
    m = x.shape[0]
    block_m = config.block_m or default_block_m(m)
    extra_m = config.extra_m
    m_tiles = -(-m // (block_m + extra_m))
    groups, num_k_tiles = weight.codes.shape[:2]
    rows_padded = groups * ROW_GROUP
    tiles, stages = config.tiles, config.num_stages
    while num_k_tiles % tiles:  # an iteration never reads past its row
        tiles //= 2
    while tiles > 1 and _pipeline_bytes(config.block_n, block_m + extra_m, tiles, stages, x) > SHARED_MEMORY_BUDGET:
        tiles //= 2
    while stages > 1 and _pipeline_bytes(config.block_n, block_m + extra_m, tiles, stages, x) > SHARED_MEMORY_BUDGET:
        stages -= 1
    grid = (m_tiles * rows_padded // config.block_n, config.split_k)
    partial_numel = config.split_k * m_tiles * rows_padded * (block_m + extra_m) if config.split_k > 1 else 1
    partials, counters = _SPLIT_K_WORKSPACE.get(x.device, partial_numel, grid[0])
    _mxfp4_matmul_kernel[grid](
        x, weight.codes, weight.scales.view(torch.int32), y, partials, counters,
        m, weight.n, num_k_tiles, m_tiles,
        x.stride(0), y.stride(0),
        float(2.0**weight.exp_offset), config.split_k,
        BLOCK_M=block_m, EXTRA_M=extra_m, BLOCK_N=config.block_n, TILES=tiles,
        FAST=fast, HAS_NAN=weight.has_nan, PREFETCH=PREFETCH_ITERATIONS,
        num_warps=config.num_warps, num_stages=stages, **pdl.launch_options(x.device),
    )  # fmt: skip


def _pipeline_bytes(block_n: int, block_m: int, tiles: int, stages: int, x: torch.Tensor) -> int:
    """Shared memory of the software pipeline: per stage a weight tile, its scales and an x tile."""
    block_k = tiles * K_TILE
    return stages * (block_n * block_k // 2 + block_n * block_k // BLOCK_SIZE + block_k * block_m * x.element_size())
