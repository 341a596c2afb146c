"""The MXFP4 weight layouts that `mxfp4_matmul` reads: `Mxfp4Weight`, `prepare_weight`, `unprepare_weight`.

The interchange format is `specchat.kernels.mxfp4`'s (codes uint8 [N, K/2], scales uint8 [N, K/32]).
`prepare_weight` turns it, once at load time, into an `Mxfp4Weight` that is the only resident copy:

- plain (the CPU): the interchange codes and scales as they are (kernels/mxfp4_dequant.py reads them).
- kernel (CUDA): a re-laid-out copy for the Triton kernel (kernels/mxfp4_matmul_kernel.py), same bytes per
  weight (K padded to 128, N to 128).

The kernel computes y^T = W @ x^T on the tensor cores with W as the register operand: each thread decodes its
own slice of W straight into the bf16 operand fragment, so no layout conversion or shared-memory round trip is
spent on the weight. The kernel layout makes that work:

- Fragment order. In the MMA's A-operand layout, lane t (of 4 sharing a row) holds, in every 32 k of a row,
  k = 2t + {0, 1, 8, 9, 16, 17, 24, 25}. A row's 128-element k-tile is 16 words, [lane t][32-k chunk q], so a
  thread reads 16 contiguous bytes per row and tile; the 64 rows of a row group are stored next to each
  other per k-tile (4 KB, scales likewise), so every load of a program step is one contiguous block.
- Bit order. Each 32-bit word holds those 8 elements as four bf16x2 pairs (k, k+1), with bits placed so that
  every pair comes out in two or three integer instructions: pair j < 3 as rotl(word, PAIR_ROTATIONS[j]) &
  0x81C081C0 (sign -> bit 15/31, exponent and mantissa -> bits 8..6 / 24..22), pair 3 as ((word & PAIR3_SOURCE)
  * PAIR3_MULTIPLIER) & 0x81C081C0: the multiply places its four bits per half with three shifted copies that
  never overlap (no carries). The 16 bits are the E2M1 value times 2^-126 as a bf16 (a subnormal for exponent
  0), so one bf16x2 multiply by 2^126 * 2^(s - 127) both fixes the bias and applies the block scale: 13
  instructions per 8 weights, the block scale once per word.
- Range. The prepared scale byte is that multiplier's bf16 exponent, s + 126 - c, so the kernel only
  multiplies it by 0x00800080 (0xFF stays NaN). c = 0 unless some block scale exceeds 2 (s > 128): then
  c = max(s) - 128, the kernel multiplies by 2^(s - 1 - c) and the output by 2^c, and blocks more than
  2^125 below the largest of their weight are flushed to zero (documented; never seen in real weights).

`unprepare_weight` inverts either layout bit for bit (to save a checkpoint, or to dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4 import BLOCK_SIZE, E8M0_NAN, mxfp4_storage_shapes

WORD_ELEMS = 8  # E2M1 elements per prepared int32 word
K_TILE = 128  # k per prepared tile: 4 lanes x 4 words x 8 elements; K is padded to this
N_TILE = 128  # prepared rows are padded to a multiple of this (the largest BLOCK_N)
ROW_GROUP = 64  # rows per group: the kernel layout stores each (row group, k-tile) contiguously
BF16_SCALE_LIMIT = 128  # largest scale code whose multiplier 2^(s - 1) is a finite bf16
KERNEL_SCALE_BIAS = 126  # prepared scale byte = s + 126 - c: the bf16 exponent field of 2^(s - 1 - c)

# Bit position, in the prepared word, of (mantissa, exponent bit 0, exponent bit 1, sign) of each of the
# 8 elements; element 2j is the low and 2j+1 the high half of bf16x2 pair j (bits 6, 7, 8, 15 of the half).
PAIR_MASK = 0x81C081C0  # a bf16x2 pair's sign, exponent bits 1..0 and top mantissa bit, both halves
PAIR_ROTATIONS = (0, 10, 13)  # pairs 0-2: rotl(word, r) & PAIR_MASK
PAIR3_SOURCE = 0x001B001B  # pair 3: bits 0, 1, 3, 4 of each half ...
PAIR3_MULTIPLIER = (1 << 3) | (1 << 8) | (1 << 14)  # ... shifted left by 3 (mantissa, exp0), 8 (exp1), 14 (sign)
_PAIR3_LO = (3, 4, 0, 1)
ELEMENT_BITS = tuple(
    tuple(
        (b + 16 * half - PAIR_ROTATIONS[j]) % 32 if j < 3 else _PAIR3_LO[i] + 16 * half
        for i, b in enumerate((6, 7, 8, 15))
    )
    for j in range(4)
    for half in (0, 1)
)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
    kt = _round_up(k, K_TILE)
    np_ = _round_up(n, N_TILE)
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
    for e, bits in enumerate(ELEMENT_BITS):
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
    if not weight.prepared:
        return weight.codes, weight.scales
    return _interchange_rows(_row_major(weight.codes), _row_major(weight.scales), weight)


def gather_rows(weight: Mxfp4Weight, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Interchange (codes [R, Kp/2], scales [R, Kp/32]) of the weight's rows `rows` [R] (int64), from either
    layout: what an embedding tied to an MXFP4 output head looks up. Fixed shapes, no host sync."""
    if not weight.prepared:
        return weight.codes[rows], weight.scales[rows]
    group, member = rows // ROW_GROUP, rows % ROW_GROUP
    words = weight.codes[group, :, member]  # [R, tiles, 16]: the row's words, k-tile by k-tile
    scales = weight.scales[group, :, member]  # [R, tiles, 4]
    return _interchange_rows(words.flatten(1), scales.flatten(1), weight, len(rows))


def _interchange_rows(
    words: torch.Tensor, kernel_scales: torch.Tensor, weight: Mxfp4Weight, n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-layout rows (words int32 [R, Kt/8], scales [R, Kt/32], row-major) -> interchange codes and scales
    of the first `n` rows (default: the weight's N)."""
    codes_shape, scales_shape = mxfp4_storage_shapes((weight.n, weight.k))
    n = weight.n if n is None else n
    rows, kt = words.shape[0], words.shape[1] * WORD_ELEMS
    words = words.reshape(rows, kt // K_TILE, 4, 4)  # [R, tile, t, q]
    el = torch.zeros((*words.shape, WORD_ELEMS), dtype=torch.int32, device=words.device)
    for e, bits in enumerate(ELEMENT_BITS):
        for field, position in enumerate(bits):
            el[..., e] |= ((words >> position) & 1) << field
    el = el.reshape(rows, kt // K_TILE, 4, 4, 4, 2).permute(0, 1, 3, 4, 2, 5).reshape(rows, kt)
    el = el[:n, : codes_shape[1] * 2].to(torch.uint8)
    codes = el[:, 0::2] | (el[:, 1::2] << 4)
    kernel_scales = kernel_scales[:n, : scales_shape[1]].int()  # flushed blocks: zero codes
    scales = kernel_scales - (KERNEL_SCALE_BIAS - weight.exp_offset)
    scales = torch.where(kernel_scales == E8M0_NAN, E8M0_NAN, scales).to(torch.uint8)
    return codes.contiguous(), scales.contiguous()
