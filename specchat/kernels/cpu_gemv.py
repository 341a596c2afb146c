"""Block-quantized matrix-vector products on the CPU: GGUF's Q4_1 and Q8_0 weights (and bf16 ones) read as stored.

A decode step multiplies a few activation rows by every weight matrix, so on a CPU it is bound by the bytes read
and by the work to turn them into floats. Dequantized to float32, a Q4_1 weight costs 4 bytes; read as stored it
costs 0.625 (16 bytes of 4-bit codes + two scales per block of 32). The kernels here read the blocks and
dequantize in registers, exactly as gguf's reference does (`w = d * q + m` for Q4_1, `w = d * q` for Q8_0,
float32, one rounding per product and per sum), then accumulate x * w in float32.

Layouts (one row per output feature n, blocks of BLOCK = 32 along the input features k):
- Q4_1: `codes` uint8 [N, K/2], block g's 16 bytes hold q[32g + j] in the low nibble of byte j and q[32g + j + 16]
  in the high nibble (GGUF's layout); `d`, `m` float32 [N, K/32]; w = d * q + m, q in 0..15.
- Q8_0: `codes` int8 [N, K]; `d` float32 [N, K/32]; w = d * q.
The scales are GGUF's float16 values widened to float32 (the AVX-512 path relies on it: d * q is then exact,
so its one fused rounding of d * q + m equals gguf's two).

`bf16_linear` multiplies float32 rows by a bfloat16 weight as stored (2 bytes a weight, widened to float32 in
registers, exactly: a bf16 is a float32's top half), summed as the Q8_0 kernels sum: a bf16 model's linears on the
CPU (engine/cpu_weights.Bf16Linear), where torch's own bf16 linears read the weights at about half the bandwidth.

Each output row is computed alone and in the same order whatever the other rows are, so the result for a token
does not depend on the batch (a verification step gives the same logits as plain decoding: lossless
speculation stays exact). The C source (csrc/cpu_gemv.c) is compiled once by kernels/cpu_build.py and loaded
through ctypes; where that fails, `available()` is False and callers keep the plain float path. `q4_linear_ref` /
`q8_linear_ref` are the plain torch references the tests hold them to.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from specchat.kernels import cpu_build

BLOCK = 32  # weights per quantization block (GGUF Q4_1 / Q8_0)
MAX_ROWS = 64  # activation rows (tokens) per call above which callers dequantize and use a float GEMM
CHUNK_ROWS = 8  # rows the kernel keeps in registers at once (MMAX in the C source)

# The C of these kernels (csrc/): fwht32.h, the 32-point fast Walsh-Hadamard transform of a RotatedFp4Linear's rows
# (x's blocks times R = H_32 / sqrt(32); cpu_gemv_i8's C builds on it too, and it is guarded, so a library of both
# holds it once), then cpu_gemv.c, the kernels bound below.
C_SOURCE = cpu_build.c_source("fwht32.h", "cpu_gemv.c")

# -O3 and the host's vector units; no contraction of multiply-adds into FMAs beyond the ones written (the
# plain-C path's dequantization rounds twice, as gguf's reference does).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"]


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached by source, flags and runtime), or None."""
    lib = cpu_build.load_part("cpu_gemv", C_SOURCE, tuple(CFLAGS))
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' argument and result types, declared on a library built from C_SOURCE."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.q4_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.q8_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, i32]
    lib.bf16_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, i32]
    lib.fp4_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32]
    lib.q4_gemm.restype = lib.q8_gemm.restype = lib.bf16_gemm.restype = None
    lib.fp4_gemm.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the compiled kernels load on this machine."""
    return _library() is not None


def _check(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, k: int) -> None:
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == k, (x.dtype, x.shape)
    assert k % BLOCK == 0 and codes.is_contiguous() and d.is_contiguous(), (k, codes.shape)
    assert d.dtype == torch.float32 and d.shape == (codes.shape[0], k // BLOCK), d.shape
    assert x.device.type == codes.device.type == "cpu"


def q4_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, threads: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a Q4_1 W (codes [N, K/2], d/m [N, K/32]) -> [M, N] float32."""
    k = codes.shape[1] * 2
    _check(x, codes, d, k)
    assert codes.dtype == torch.uint8 and m.shape == d.shape and m.dtype == torch.float32 and m.is_contiguous()
    lib = _library()
    assert lib is not None, "cpu_gemv.available() is False"
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    lib.q4_gemm(
        x.shape[0], codes.shape[0], k, x.data_ptr(), codes.data_ptr(), d.data_ptr(), m.data_ptr(), y.data_ptr(), threads
    )
    return y


def q8_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, threads: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a Q8_0 W (codes int8 [N, K], d [N, K/32]) -> [M, N] float32."""
    k = codes.shape[1]
    _check(x, codes, d, k)
    assert codes.dtype == torch.int8
    lib = _library()
    assert lib is not None, "cpu_gemv.available() is False"
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    lib.q8_gemm(x.shape[0], codes.shape[0], k, x.data_ptr(), codes.data_ptr(), d.data_ptr(), y.data_ptr(), threads)
    return y


def _check_bf16(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.dim() == 2, (weight.dtype, weight.shape)
    k = weight.shape[1]
    assert k % BLOCK == 0 and weight.device.type == "cpu", (k, weight.device)
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == k, (x.dtype, x.shape)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a bfloat16 W [N, K] (K a multiple of 32) -> [M, N] float32, the weights
    widened exactly and every product and sum in float32 (`bf16_linear_ref`)."""
    _check_bf16(x, weight)
    lib = _library()
    assert lib is not None, "cpu_gemv.available() is False"
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    lib.bf16_gemm(x.shape[0], weight.shape[0], weight.shape[1], x.data_ptr(), weight.data_ptr(), y.data_ptr(), threads)
    return y


def _check_fp4(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    n, k = codes.shape[0], codes.shape[1] * 2
    assert codes.dtype == scales.dtype == torch.uint8 and codes.is_contiguous() and scales.is_contiguous()
    assert scales.shape == (n, k // BLOCK) and codes.device.type == scales.device.type == "cpu", scales.shape
    assert not bool((scales == 0xFF).any()), "an MXFP4 block with a NaN scale"
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] == k, (x.dtype, x.shape)


def fp4_linear(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, threads: int, rotate: bool = False
) -> torch.Tensor:
    """x [M, K] float32 @ W^T for an MXFP4 W in the interchange layout (codes uint8 [N, K/2], element 2j in the low
    nibble of byte j; E8M0 scales uint8 [N, K/32], no NaN block) -> [M, N] float32 (`fp4_linear_ref`); `rotate`:
    (x R) @ W^T, R = blockdiag(H_32 / sqrt(32)), for a weight quantized as W R."""
    return Bound(codes, scales, rotate=rotate)(x, threads)


class Bound:
    """A Q4_1 / Q8_0 weight (or a bfloat16 one: `codes` the weight [N, K], no scales; or an MXFP4 one: `d` its E8M0
    scales, uint8) checked once and its pointers taken once, for the many small calls of decoding: `bound(x,
    threads)` is q4_linear / q8_linear / bf16_linear / fp4_linear less the per-call checks of the weight (~3 us a
    call instead of ~12). Holds the weight tensors, so the pointers stay valid; callers rebind when they replace
    them."""

    def __init__(
        self, codes: torch.Tensor, d: torch.Tensor | None = None, m: torch.Tensor | None = None, rotate: bool = False
    ):
        lib = _library()
        assert lib is not None, "cpu_gemv.available() is False"
        self.n = codes.shape[0]
        self.kind, self.rotate, self._extra = "q4_1" if m is not None else "q8_0", False, ()
        if d is None:
            self.k, self.kind = codes.shape[1], "bf16"
            _check_bf16(torch.empty(0, self.k), codes)
            self.tensors, self._fn = (codes,), lib.bf16_gemm
        elif d.dtype == torch.uint8:  # MXFP4: d holds the E8M0 scales; rotate: x's blocks times R first
            self.k, self.kind, self.rotate, self._extra = codes.shape[1] * 2, "mxfp4", rotate, (int(rotate),)
            _check_fp4(torch.empty(0, self.k), codes, d)
            self.tensors, self._fn = (codes, d), lib.fp4_gemm
        else:
            self.k = codes.shape[1] * (2 if m is not None else 1)
            _check(torch.empty(0, self.k), codes, d, self.k)
            if m is not None:
                assert codes.dtype == torch.uint8 and m.shape == d.shape and m.dtype == torch.float32
                assert m.is_contiguous()
            else:
                assert codes.dtype == torch.int8
            self.tensors = (codes, d) if m is None else (codes, d, m)
            self._fn = lib.q4_gemm if m is not None else lib.q8_gemm
        self._ptrs = tuple(t.data_ptr() for t in self.tensors)

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [M, K] float32 contiguous on the CPU -> [M, N] float32."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.k or x.is_cuda:
            raise ValueError(
                f"cpu_gemv: x must be float32 [M, {self.k}] contiguous on the CPU, got {x.dtype} {x.shape}"
            )
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if self._fn(x.shape[0], self.n, self.k, x.data_ptr(), *self._ptrs, y.data_ptr(), threads, *self._extra):
            raise MemoryError("cpu_gemv: no memory for the MXFP4 kernel's rows")
        return y


# --- the plain references ---------------------------------------------------------------------------------
def q4_codes(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q4_1 codes [N, K/2] (d [N, K/32] for the shape) -> q [N, K] uint8, 0..15: each block's 16 low nibbles,
    then its 16 high nibbles (GGUF's order)."""
    n, g = d.shape
    blocks = codes.view(n, g, BLOCK // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).view(n, g * BLOCK)


def q4_dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """codes [N, K/2], d/m [N, K/32] -> W [N, K] float32, as gguf's Q4_1 dequantization computes it."""
    n, g = d.shape
    q = q4_codes(codes, d).float().view(n, g, BLOCK)
    return (d[..., None] * q + m[..., None]).view(n, g * BLOCK)


def q8_dequantize(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, K], d [N, K/32] -> W [N, K] float32 (w = q * d)."""
    n, g = d.shape
    return (codes.view(n, g, BLOCK).float() * d[..., None]).view(n, g * BLOCK)


def q4_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x @ q4_dequantize(codes, d, m).T


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return x @ q8_dequantize(codes, d).T


def bf16_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.float().T


def fp4_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rotate: bool = False) -> torch.Tensor:
    from specchat.kernels.mxfp4 import dequantize_mxfp4, rotate_blocks

    return (rotate_blocks(x) if rotate else x) @ dequantize_mxfp4(codes, scales, torch.float32).T
