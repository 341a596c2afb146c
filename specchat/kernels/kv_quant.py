"""Element formats of KV pages and quantize-on-append: the torch reference, which the Triton kernel equals.

One layer's keys (or values) live in a `PageTensor`: rows [kv_heads, slots, ...], one row per token and KV
head, in one of three element formats:

- "dense": the floats as they are (bf16 / fp16 / fp32), data [KVH, S, D].
- "mxfp4": OCP MX v1.0 FP4 (E2M1) elements, blocks of 32 along head_dim sharing an E8M0 scale, in the
  interchange layout of `specchat.kernels.mxfp4`: codes [KVH, S, D/2] (element 2j in the low nibble of
  byte j) + scales [KVH, S, D/32]. 4.25 bits per element.
- "mxfp8": OCP MX v1.0 FP8 (E4M3, bias 7, max 448, no infinities) elements with the same E8M0 block scales:
  codes [KVH, S, D] (the E4M3 bit patterns) + scales [KVH, S, D/32]. 8.25 bits per element.

Head-major rows ([KVH, S, ...]) keep one page of one head contiguous, which is what attention reads.

Scale rules. MXFP4 takes any rule of `quantize_mxfp4` ("mse" by default: of the exponents ocp - 1, ocp,
ocp + 1 the one with the least squared error). MXFP8 uses the round-up rule, 2^ceil(log2(amax / 448)): E4M3
has 3 mantissa bits across 17 binades, so never clipping the largest element costs nothing measurable, while
the OCP rule (floor(log2 amax) - 8) would clip up to 1/8 of the top binade of outlier keys to 448.

The Triton kernel (kernels/kv_quant_triton.py, imported at its first launch: the CPU path never imports Triton)
writes a step's rows straight into their slots and equals the reference bit for bit, except for blocks whose
largest magnitude is below 2^-124, where float32 subnormals may round differently on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4 import (
    BLOCK_SIZE,
    E2M1_EMAX,
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_NAN,
    RULES,
    round_to_e2m1,
    scales_to_float,
)

DENSE, MXFP4, MXFP8 = "dense", "mxfp4", "mxfp8"
ELEMENT_FORMATS = (DENSE, MXFP4, MXFP8)
DEFAULT_RULE = "mse"  # MXFP4 scale rule for KV rows (least squared error; see the module docstring)

E4M3_MAX = 448.0  # E4M3 (bias 7, 3 mantissa bits, subnormals below 2^-6, no infinities)
E4M3_EMAX = 8  # 448 = 1.75 * 2^8

_MSE_OFFSETS = (0, 1, -1)  # candidate exponents around the OCP one, in the reference's tie-break order
_E2M1_MAGNITUDES = torch.tensor(E2M1_MAGNITUDES)
# byte -> (value of the low nibble, value of the high nibble): one gather decodes two MXFP4 elements.
_E2M1_BYTE_PAIRS = torch.tensor(
    [[(-1.0 if (n >> 3) & 1 else 1.0) * E2M1_MAGNITUDES[n & 7] for n in (byte & 0xF, byte >> 4)] for byte in range(256)]
)


def code_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one row's codes in a quantized element format."""
    return {MXFP4: head_dim // 2, MXFP8: head_dim}[fmt]


def row_bytes(fmt: str, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's row for one KV head, scales included."""
    if fmt == DENSE:
        return head_dim * dtype.itemsize
    return code_bytes(fmt, head_dim) + head_dim // BLOCK_SIZE


# --- torch reference ------------------------------------------------------------------------------------


def _round_up_exponent(amax: torch.Tensor, emax: int, elem_max: float) -> torch.Tensor:
    """Smallest E8M0 exponent e with amax / 2^e <= elem_max (blocks of zeros get the smallest)."""
    _, frexp_exp = torch.frexp(amax)  # amax = m * 2^frexp_exp, m in [0.5, 1)
    exponent = frexp_exp.to(torch.int32) - 1 - emax
    exponent = exponent + (amax > elem_max * torch.ldexp(torch.ones_like(amax), exponent.float())).to(torch.int32)
    return torch.where(amax > 0, exponent, E8M0_MIN_EXP).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float [..., K] (K a multiple of 32) -> (E4M3 codes uint8 [..., K], E8M0 scales uint8 [..., K/32])."""
    *lead, k = x.shape
    assert k % BLOCK_SIZE == 0, x.shape
    blocks = x.float().reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)  # [..., K/32, 32]
    finite = torch.isfinite(blocks).all(dim=-1)  # [..., K/32]
    amax = torch.where(finite, blocks.abs().amax(dim=-1), 0.0)
    exponent = _round_up_exponent(amax, E4M3_EMAX, E4M3_MAX)
    scaled = blocks * torch.ldexp(torch.ones_like(amax), -exponent.float())[..., None]
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite[..., None], codes, 0)
    scales = torch.where(finite, (exponent + E8M0_BIAS).to(torch.uint8), E8M0_NAN).to(torch.uint8)
    return codes.reshape(*lead, k), scales


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [..., K], scales [..., K/32]) -> values [..., K]."""
    *lead, k = codes.shape
    values = codes.view(torch.float8_e4m3fn).float().reshape(*lead, k // BLOCK_SIZE, BLOCK_SIZE)
    return (values * scales_to_float(scales)[..., None]).reshape(*lead, k).to(dtype)


def dequantize_mxfp4_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_mxfp4` with one table lookup per byte (both nibbles): the CPU read path of MXFP4 pages."""
    *lead, half = codes.shape
    pairs = F.embedding(codes.int(), _E2M1_BYTE_PAIRS.to(codes.device))  # [..., K/2, 2]
    values = pairs.reshape(*lead, 2 * half // BLOCK_SIZE, BLOCK_SIZE)  # [..., K/32, 32]
    return (values * scales_to_float(scales)[..., None]).reshape(*lead, 2 * half).to(dtype)


def quantize_mxfp4_rows(x: torch.Tensor, rule: str = DEFAULT_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_mxfp4` for K a multiple of 32, equal to it bit for bit, in a fixed number of tensor ops.

    Per-step KV rows are small, so the reference's op count, not its arithmetic, is what costs on CPU: here all
    candidate exponents of the "mse" rule are rounded at once, and their squared errors compared in float64 as
    the reference does.
    """
    *lead, k = x.shape
    assert k % BLOCK_SIZE == 0 and rule in RULES, (x.shape, rule)
    blocks = x.float().reshape(-1, BLOCK_SIZE)  # [N, 32]
    amax = blocks.abs().amax(dim=-1)  # [N]; NaN or inf when the block holds one
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, 0.0)
    ocp = torch.frexp(amax)[1] - 1 - E2M1_EMAX  # floor(log2 amax) - emax(E2M1)
    ocp = torch.where(amax > 0, ocp, E8M0_MIN_EXP)
    if rule == "roundup":
        ocp = ocp + (amax > E2M1_MAX * torch.ldexp(torch.ones_like(amax), ocp.clamp(min=E8M0_MIN_EXP).float()))
    offsets = torch.tensor(_MSE_OFFSETS if rule == "mse" else (0,), dtype=torch.int32, device=x.device)
    exponents = (ocp[:, None] + offsets).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)  # [N, C] candidates, in tie order
    scale = torch.ldexp(torch.ones_like(exponents, dtype=torch.float32), exponents.float())  # [N, C]
    codes = round_to_e2m1(blocks[:, None, :] / scale[..., None])  # [N, C, 32], sign in bit 3
    if rule == "mse":
        magnitude = _E2M1_MAGNITUDES.to(x.device)[(codes & 0x7).long()] * scale[..., None]
        error = magnitude.double() - blocks.abs()[:, None, :].double()
        best = (error * error).sum(dim=-1).argmin(dim=-1, keepdim=True)  # [N, 1]: the first of equal errors
        codes = codes.gather(1, best[..., None].expand(-1, 1, BLOCK_SIZE))
        exponents = exponents.gather(1, best)
    codes = torch.where(finite[:, None], codes[:, 0], 0)  # [N, 32]
    scales = torch.where(finite, (exponents[:, 0] + E8M0_BIAS).to(torch.uint8), E8M0_NAN).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2j in the low nibble
    return packed.reshape(*lead, k // 2), scales.reshape(*lead, k // BLOCK_SIZE)


def quantize_rows(x: torch.Tensor, fmt: str, rule: str = DEFAULT_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] -> (codes, scales) of a quantized element format."""
    if fmt == MXFP4:
        return quantize_mxfp4_rows(x, rule)
    return quantize_mxfp8(x)


@dataclass(slots=True)
class PageTensor:
    """One layer's keys or values: rows [KVH, slots, ...] in one element format (see the module docstring)."""

    fmt: str
    data: torch.Tensor  # dense: values [KVH, S, D]; mxfp4: codes [KVH, S, D/2]; mxfp8: codes [KVH, S, D]
    scales: torch.Tensor | None  # E8M0 [KVH, S, D/32]; None for dense
    rule: str = DEFAULT_RULE  # MXFP4 scale rule

    @classmethod
    def empty(
        cls, fmt: str, num_kv_heads: int, num_slots: int, head_dim: int, dtype: torch.dtype, device, rule: str
    ) -> PageTensor:
        """Uninitialised rows: slots are only read after they are written."""
        assert fmt in ELEMENT_FORMATS and rule in RULES, (fmt, rule)
        if fmt == DENSE:
            return cls(fmt, torch.empty(num_kv_heads, num_slots, head_dim, dtype=dtype, device=device), None)
        assert head_dim % BLOCK_SIZE == 0, head_dim
        data = torch.empty(num_kv_heads, num_slots, code_bytes(fmt, head_dim), dtype=torch.uint8, device=device)
        scales = torch.empty(num_kv_heads, num_slots, head_dim // BLOCK_SIZE, dtype=torch.uint8, device=device)
        return cls(fmt, data, scales, rule)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store rows x [T, KVH, D] at slots [T] (quantizing on the way in)."""
        if self.fmt == DENSE:
            self.data[:, slots] = x.transpose(0, 1).to(self.data.dtype)
        elif x.is_cuda and triton_supported(x.shape[-1]):
            from specchat.kernels import kv_quant_triton

            kv_quant_triton.quantize_into_pages(x, slots, self)
        else:
            codes, scales = quantize_rows(x, self.fmt, self.rule)  # [T, KVH, ...]
            self.data[:, slots] = codes.transpose(0, 1)
            self.scales[:, slots] = scales.transpose(0, 1)

    def read(self, index: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Rows [KVH, n, D] of the given slots (a slot tensor, or a slice for a contiguous run), in dtype."""
        if self.fmt == DENSE:
            return self.data[:, index].to(dtype)
        if self.fmt == MXFP4:
            return dequantize_mxfp4_rows(self.data[:, index], self.scales[:, index], dtype)
        return dequantize_mxfp8(self.data[:, index], self.scales[:, index], dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows slot-for-slot (the bytes, no requantization)."""
        self.data[:, dst] = self.data[:, src]
        if self.scales is not None:
            self.scales[:, dst] = self.scales[:, src]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


def triton_supported(head_dim: int) -> bool:
    """Whether the kernel (kernels/kv_quant_triton.py) takes rows of head_dim: it tiles a row as (head_dim / 32)
    blocks, a power-of-two count."""
    blocks = head_dim // BLOCK_SIZE
    return head_dim % BLOCK_SIZE == 0 and blocks & (blocks - 1) == 0
