"""MXFP4, the OCP Microscaling format with FP4 elements: a plain-torch reference.

Spec: OCP Microscaling Formats (MX) v1.0, sections 5.2 (E8M0 scale), 5.3.3 (FP4 E2M1 element) and 6.3
(conversion from a wider format). One block of 32 consecutive elements along the last axis shares one scale:

    value_i = 2^(s - 127) * e2m1(code_i)

- Element E2M1: bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa. Magnitudes by code
  0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6. No Inf or NaN.
- Scale E8M0: an unsigned biased exponent, 2^(s - 127) for s in 0..254; s = 0xFF is NaN and makes the whole
  block NaN.
- Storage (this project's interchange layout): codes uint8 [..., K/2], element 2j in the low nibble and
  element 2j+1 in the high nibble of byte j; scales uint8 [..., K/32]. K is padded with zeros up to a multiple
  of 32: 4.25 bits per element.

Encoding rules (`quantize_mxfp4(rule=...)`), all producing spec-compliant blocks:
- "ocp": the spec's shared exponent floor(log2(amax)) - 2 (2 = emax of E2M1), elements x / 2^e rounded to
  nearest, ties to even, on the E2M1 grid and saturated at +-6. Up to 1/4 of the top binade clips.
- "roundup": the smallest exponent with amax / 2^e <= 6, i.e. 2^ceil(log2(amax / 6)); never clips.
- "mse": per block, the exponent among ocp - 1, ocp, ocp + 1 with the least squared error after rounding
  (ties prefer ocp, then ocp + 1).

Special inputs (defined here, not by the spec):
- All-zero block: scale code 0 (2^-127), codes 0 (or 8 for -0.0 elements); dequantizes to zeros.
- Tiny blocks: the exponent is clamped to E8M0's range, so a block whose amax is below 2^-125 gets scale
  2^-127 and its elements round (mostly to zero) on that grid. Huge blocks cannot overflow the scale: a
  finite float32 has amax < 2^128, so the ocp exponent is at most 125 and the roundup exponent at most 126.
  Dequantized values follow the target dtype: "ocp" and "mse" blocks of float32 input stay finite in
  float32, but "roundup" may round an element above 3.5 * 2^126 up to 4 * 2^126 = 2^128, which is inf there.
- NaN or +-Inf anywhere in a block: scale 0xFF (NaN) and codes 0, so the whole block dequantizes to NaN.
  An infinite weight is a bug upstream; saturating it would silently corrupt its 31 neighbours instead.
- Signs follow the float's sign bit: a negative value that rounds to zero (and -0.0) encodes as -0 (code 8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from typing import Literal

import torch

from specchat.config import MXFP4_RULES

BLOCK_SIZE = 32  # elements sharing one E8M0 scale
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by code & 7
E2M1_SIGN_BIT = 0x8
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest normal E2M1 value, 6 = 1.5 * 2^2
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP = -127  # code 0
E8M0_MAX_EXP = 127  # code 254

# Round-to-nearest-even on the E2M1 magnitude grid as a count of decision points passed: the code of |v| is
# the number of midpoints below it. At a midpoint the tie goes to the neighbour with an even code (mantissa
# bit 0), so ties towards an even upper code use >= and ties towards an even lower code use >.
# Midpoints between codes (0,1) (1,2) (2,3) (3,4) (4,5) (5,6) (6,7):
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)

Rule = Literal["ocp", "roundup", "mse"]
RULES: tuple[str, ...] = MXFP4_RULES
_MSE_EXP_OFFSETS = (0, 1, -1)  # candidates relative to the ocp exponent, in tie-break order


def padded_k(k: int) -> int:
    """K rounded up to a whole number of blocks."""
    return (k + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE


def mxfp4_storage_shapes(shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (codes, scales) for a tensor of logical shape [..., K]."""
    *lead, k = shape
    kp = padded_k(k)
    return (*lead, kp // 2), (*lead, kp // BLOCK_SIZE)


def mxfp4_nbytes(shape: Sequence[int]) -> int:
    """Bytes of packed codes plus scales for a tensor of logical shape [..., K]."""
    codes_shape, scales_shape = mxfp4_storage_shapes(shape)
    return math.prod(codes_shape) + math.prod(scales_shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., K] (K even) -> bytes [..., K/2], element 2j in the low nibble."""
    assert codes.dtype == torch.uint8 and codes.shape[-1] % 2 == 0, (codes.dtype, codes.shape)
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)  # [..., K/2, 2]
    return (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] -> uint8 codes 0..15 [..., K]; inverse of `pack_nibbles`."""
    assert packed.dtype == torch.uint8, packed.dtype
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], -1)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Float32 values already divided by the block scale -> E2M1 codes (uint8 0..15), RNE, saturating at 6."""
    magnitude = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for midpoint, tie_up in zip(E2M1_MIDPOINTS, E2M1_TIE_ROUNDS_UP, strict=True):
        passed = magnitude >= midpoint if tie_up else magnitude > midpoint
        code += passed.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) -> float32 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 0x7).long()]
    return torch.where((codes & E2M1_SIGN_BIT) != 0, -magnitude, magnitude)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact 2^e in float32 for integer e in [-149, 127] (the E8M0 range and float32 subnormals)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.float32))


def _ocp_exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) - emax(E2M1), exactly, from the float's exponent field; amax == 0 gives -inf-ish."""
    _, frexp_exp = torch.frexp(amax)  # amax = m * 2^frexp_exp, m in [0.5, 1)
    exponent = frexp_exp.to(torch.int32) - 1 - E2M1_EMAX
    return torch.where(amax > 0, exponent, torch.full_like(exponent, E8M0_MIN_EXP))


def quantize_mxfp4(x: torch.Tensor, rule: Rule = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    """Float tensor [..., K] -> (codes uint8 [..., Kp/2], scales uint8 [..., Kp/32]), Kp = K padded to 32."""
    if rule not in RULES:
        raise ValueError(f"unknown MXFP4 rounding rule {rule!r}; expected one of {RULES}")
    assert x.is_floating_point() and x.dim() >= 1, (x.dtype, x.shape)
    *lead, k = x.shape
    kp = padded_k(k)
    xf = torch.nn.functional.pad(x.to(torch.float32), (0, kp - k))  # [..., Kp]
    blocks = xf.reshape(*lead, kp // BLOCK_SIZE, BLOCK_SIZE)  # [..., Kp/32, 32]

    finite = torch.isfinite(blocks).all(dim=-1)  # [..., Kp/32]
    amax = torch.where(finite, blocks.abs().amax(dim=-1), torch.zeros_like(finite, dtype=torch.float32))
    exponent = _ocp_exponent(amax)  # [..., Kp/32]

    if rule == "roundup":
        # amax / 2^e_ocp lies in [4, 8); above 6 the next exponent is the smallest that does not clip.
        exponent = exponent + (amax * _pow2(-exponent.clamp(min=E8M0_MIN_EXP)) > E2M1_MAX).to(torch.int32)
    elif rule == "mse":
        exponent = _least_squares_exponent(blocks, exponent)
    exponent = exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)

    codes = round_to_e2m1(blocks * _pow2(-exponent)[..., None])  # [..., Kp/32, 32]
    codes = torch.where(finite[..., None], codes, torch.zeros_like(codes))
    scales = torch.where(finite, (exponent + E8M0_BIAS).to(torch.uint8), torch.full_like(codes[..., 0], E8M0_NAN))
    return pack_nibbles(codes.reshape(*lead, kp)), scales


def _least_squares_exponent(blocks: torch.Tensor, ocp_exponent: torch.Tensor) -> torch.Tensor:
    """Per block, the candidate exponent with the least squared rounding error (blocks [..., nb, 32])."""
    best_exp = ocp_exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    best_err = torch.full_like(blocks[..., 0], math.inf, dtype=torch.float64)
    for offset in _MSE_EXP_OFFSETS:
        candidate = (ocp_exponent + offset).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        scale = _pow2(candidate)[..., None]
        # dequantize in float32 (a candidate that overflows it gets an infinite error), square in float64
        error = (e2m1_to_float(round_to_e2m1(blocks / scale)) * scale).double() - blocks.double()
        err = (error**2).sum(dim=-1)
        better = err < best_err  # strict: earlier candidates win ties
        best_exp = torch.where(better, candidate, best_exp)
        best_err = torch.where(better, err, best_err)
    return best_exp


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) -> float32 2^(s - 127), NaN for 0xFF."""
    value = _pow2(scales.to(torch.int32) - E8M0_BIAS)
    return torch.where(scales == E8M0_NAN, torch.full_like(value, math.nan), value)


def dequantize_mxfp4(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, k: int | None = None
) -> torch.Tensor:
    """(codes [..., Kp/2], scales [..., Kp/32]) -> values [..., Kp] in dtype; k trims the padding off."""
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8, (codes.dtype, scales.dtype)
    kp = codes.shape[-1] * 2
    assert scales.shape[-1] * BLOCK_SIZE == kp and codes.shape[:-1] == scales.shape[:-1], (
        codes.shape,
        scales.shape,
    )
    values = e2m1_to_float(unpack_nibbles(codes)).reshape(*scales.shape, BLOCK_SIZE)  # [..., Kp/32, 32]
    values = (values * scales_to_float(scales)[..., None]).reshape(*codes.shape[:-1], kp)  # [..., Kp]
    if k is not None:
        assert 0 < k <= kp, (k, kp)
        values = values[..., :k]
    return values.to(dtype)


def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two): symmetric, its own inverse. Made once
    per order, dtype and device (on the CPU it is every RotatedFp4Linear call's: built anew it took a fifth of an
    MXFP4 decode step there; on CUDA a copy from the host at each call cannot be captured in a graph, and a rotated
    model's graphs are captured after the warm-up runs that make it); read it, do not write it."""
    assert n > 0 and n & (n - 1) == 0, n
    return _hadamard(n, dtype, torch.device(device))


@cache
def _hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return _hadamard(n, dtype, torch.device("cpu")).to(device=device)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(n)).to(dtype=dtype)


def rotate_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) times R = blockdiag(H_32 / sqrt(32)) on the right; R = R^T = R^-1 (the
    rotation a RotatedFp4Linear's weight is quantized under, quant/fp4_linear.py)."""
    *lead, k = x.shape
    assert k % BLOCK_SIZE == 0, f"block rotation needs K a multiple of {BLOCK_SIZE}, got {k}"
    blocks = x.reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)  # [..., K/32, 32]
    return (blocks @ hadamard(BLOCK_SIZE, x.dtype, x.device)).reshape(x.shape)
