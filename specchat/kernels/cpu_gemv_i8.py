"""Block-quantized matrix products on the CPU with int8 activations: GGUF Q4_1 / Q8_0 and MXFP4 weights,
AVX512-VNNI or AVX2.

kernels/cpu_gemv.py dequantizes each weight block to float32 and does one float FMA per weight and activation row,
so a 5-row verification step costs ~2x a 1-row decode step on a 2-core CPU. Here, as llama.cpp does, each
activation row is quantized per block of 32 to int8 with one float32 scale, and a block's dot product is integer:

    dx = max|x_j| / 127,  xq_j = round(x_j / dx)  (round half to even; xq_j in -127..127, all zero where dx = 0)
    Q4_1 (w_j = dw * q_j + mw, q_j in 0..15):  sum_j w_j x_j ~= (dw * dx) * sum_j q_j xq_j + mw * (dx * sum_j xq_j)
    Q8_0 (w_j = dw * q_j, q_j in -127..127):   sum_j w_j x_j ~= (dw * dx) * sum_j q_j xq_j
    MXFP4 (w_j = 2^(e-127) * v_j, v_j E2M1):   sum_j w_j x_j ~= (2^(e-127) * (dx / 2)) * sum_j (2 v_j) xq_j

`_mm512_dpbusd_epi32` multiplies unsigned by signed bytes and adds each four products into a 32-bit lane: 64
products an instruction, against 16 for a float FMA. Q4_1 codes are unsigned already; Q8_0 codes are stored
offset by 128 (0..255) and the block's sum starts at -128 * sum_j xq_j, which makes it exactly sum_j q_j xq_j.
MXFP4 codes become 2 v_j + 12 (0..24; twice an E2M1 value is an integer in -12..12) by one shuffle_epi8 per 16, and
the block's sum starts at -12 * sum_j xq_j. Its scale is the float32 with exponent bits e (e = 0 reads as 0.0, not
the subnormal 2^-127; e = 255, NaN, is refused by `repack_fp4`). A RotatedFp4Linear's rows are rotated per block
(x R, a fast Walsh-Hadamard transform) before they are quantized.

Layout: the weights are repacked once (`repack_q4` / `repack_q8`) so that a 32-bit lane is one output row: per
group of 16 output rows and block g, word v (4 consecutive bytes of the block, as GGUF stores them) of each of the
16 rows side by side in one 64-byte vector. A Q4_1 word holds q[4v..4v+3] in its low nibbles and q[4v+16..4v+19]
in its high nibbles (GGUF's layout), so one load and two masks give the lanes for two 4-byte activation words,
each broadcast to all lanes. The integer block sums come out one per output lane, with no horizontal reduction;
the scales are stored [group, block, 16] to match, as float16 (GGUF's own scale type, exact in float32; float32
scales made a Q4_1 weight 0.75 bytes, float16 0.625: the single-thread decode step reads its weights from DRAM).
Rows past N (a last partial group) are zero weights, not stored. MXFP4 (`repack_fp4`) takes the same layout: each
block's bytes reordered to Q4_1's nibble order, the E8M0 scales [group, block, 16] as stored (the same bytes as the
interchange form, which `unpack_fp4` gives back).

The float combination is fixed: per (row, output), over the blocks in order, acc += (dw * dx) * isum, then (Q4_1)
acc += mw * (dx * sum xq) (MXFP4: acc += (2^(e-127) * (dx * 0.5)) * isum), each product and sum rounded once (no
FMA contraction). The integer sums are exact, so an output depends only on its own activation row, never on the
batch, tile or thread (a verification step gives plain decoding's logits bit for bit: lossless speculation stays
exact), and `q4_linear_ref` / `q8_linear_ref` / `fp4_linear_ref` below, the same math in plain torch, give the
same bits. Without AVX512-VNNI and AVX512-BW at build time the
AVX2 build emulates dpbusd with maddubs + madd (the same integers, so the same bits; 2.4x the float AVX2 kernels
per token on an AMD EPYC, docs/benchmarks.md); without either, `available()` is False and callers keep float
activations (kernels/cpu_gemv.py).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from specchat.kernels import cpu_build, cpu_gemv
from specchat.kernels.mxfp4 import E8M0_NAN, e2m1_to_float, pack_nibbles, scales_to_float, unpack_nibbles

BLOCK = cpu_gemv.BLOCK  # weights per quantization block (GGUF Q4_1 / Q8_0), and activations per int8 scale
GROUP = 16  # output rows interleaved in one vector: one 32-bit lane each
Q4_WORDS, Q8_WORDS = 4, 8  # 4-byte words per block and output row: 16 bytes of nibbles, 32 bytes of int8 codes
Q8_OFFSET = 128  # added to the signed Q8_0 codes so they are dpbusd's unsigned operand

# The C of these kernels (csrc/): cpu_gemv's fwht32.h (a RotatedFp4Linear's rows rotated), then cpu_gemv_i8.c.
C_SOURCE = cpu_build.c_source("fwht32.h", "cpu_gemv_i8.c")


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached), or None where they do not build or lack VNNI."""
    lib = cpu_build.load_part("cpu_gemv_i8", C_SOURCE, tuple(cpu_gemv.CFLAGS))
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """A build of C_SOURCE with its functions' argument types set, or None where it lacks the int8 kernels (neither
    AVX512-VNNI nor AVX2). benchmarks/cpu_gemv.py binds an earlier revision's build with it too."""
    if lib.i8_has_vnni() != 1:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.i8_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.i8_gemm.restype = ctypes.c_int
    lib.i8_quantize_rows.argtypes = [i32, i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.i8_quantize_rows.restype = None
    if hasattr(lib, "fp4i8_gemm"):  # (an earlier revision's build, benchmarks/cpu_gemv.py's baseline, has none)
        lib.fp4i8_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32]
        lib.fp4i8_gemm.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the int8-activation kernels load on this machine (a C compiler and a CPU with AVX512-VNNI or
    AVX2)."""
    return _library() is not None


def _interleave(words: torch.Tensor, n: int, g: int, per_block: int) -> torch.Tensor:
    """int32 words [N, G * per_block] -> [ceil(N/16), G, per_block, 16] (rows past N zero), as bytes: one pass
    over the weight where N is whole groups (every load repacks every linear)."""
    groups = -(-n // GROUP)
    if groups * GROUP != n:
        padded = torch.zeros(groups * GROUP, g * per_block, dtype=torch.int32)
        padded[:n] = words
        words = padded
    return words.reshape(groups, GROUP, g, per_block).permute(0, 2, 3, 1).contiguous().view(torch.uint8)


def _scales(t: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 scales that float16 holds exactly (GGUF's are float16) -> float16 [ceil(N/16), G, 16] (rows
    past N zero): half the bytes of float32, and a tenth of what a Q4_1 row reads (d and m)."""
    n, g = t.shape
    half = t.half()
    if not torch.equal(half.float(), t):
        raise ValueError("cpu_gemv_i8: block scales must be float16 values (as GGUF stores them)")
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, g, dtype=torch.float16)
    padded[:n] = half
    return padded.view(groups, GROUP, g).transpose(1, 2).contiguous()


def repack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_1 (codes uint8 [N, K/2], d/m [N, K/32]) -> (words, d, m) in the kernel's interleaved layout."""
    n, g = d.shape
    words = codes.contiguous().view(torch.int32)  # [N, G * 4]: word v of block g at g * 4 + v
    return _interleave(words, n, g, Q4_WORDS), _scales(d), _scales(m)


def repack_q8(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GGUF Q8_0 (codes int8 [N, K], d [N, K/32]) -> (words of codes + 128, d) in the kernel's layout."""
    n, g = d.shape
    shifted = codes.contiguous().view(torch.uint8) ^ Q8_OFFSET  # x + 128 mod 256: its sign bit flipped
    return _interleave(shifted.view(torch.int32), n, g, Q8_WORDS), _scales(d)


def _check_fp4(codes: torch.Tensor, scales: torch.Tensor) -> None:
    n, g = scales.shape
    assert codes.dtype == scales.dtype == torch.uint8 and codes.shape == (n, g * BLOCK // 2), (codes.shape, g)
    assert codes.device.type == scales.device.type == "cpu", codes.device
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("cpu_gemv_i8: an MXFP4 block with a NaN scale (E8M0 0xFF)")


def repack_fp4(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 in the interchange layout (codes uint8 [N, K/2], element 2j of a block in the low nibble of its byte j;
    E8M0 scales uint8 [N, K/32], none 0xFF) -> (words, scales) in the kernel's layout: each block's bytes reordered
    to Q4_1's (byte j: element j low, element j + 16 high), then interleaved as repack_q4's; the scales as stored,
    [ceil(N/16), G, 16]. The same bytes as the interchange form, rows padded to a whole group of 16."""
    _check_fp4(codes, scales)
    n, g = scales.shape
    elements = unpack_nibbles(codes).view(n, g, BLOCK)  # [N, G, 32] codes 0..15
    q4_order = elements[..., : BLOCK // 2] | (elements[..., BLOCK // 2 :] << 4)  # [N, G, 16]
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, g, dtype=torch.uint8)
    padded[:n] = scales
    words = _interleave(q4_order.view(n, g * Q4_WORDS * 4).view(torch.int32), n, g, Q4_WORDS)
    return words, padded.view(groups, GROUP, g).transpose(1, 2).contiguous()


def _fp4_elements(words: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` [R] of repack_fp4's (words, scales) -> (element codes uint8 [R, K], 0..15, E8M0 scales [R, K/32])."""
    groups, g, _ = scales.shape
    q4_order = words.view(groups, g, Q4_WORDS, GROUP, 4)[rows // GROUP, :, :, rows % GROUP]  # [R, G, 4, 4]
    q4_order = q4_order.reshape(-1, g, BLOCK // 2)
    elements = torch.cat([q4_order & 15, q4_order >> 4], dim=-1)  # [R, G, 32]: element j of each block at j
    return elements.view(-1, g * BLOCK), scales[rows // GROUP, :, rows % GROUP]


def unpack_fp4(words: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """repack_fp4's inverse: (words, scales) of N rows -> interchange (codes uint8 [N, K/2], scales uint8 [N, K/32])."""
    elements, row_scales = _fp4_elements(words, scales, torch.arange(n))
    return pack_nibbles(elements), row_scales


def fp4_rows(words: torch.Tensor, scales: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [R] of repack_fp4's (words, scales), dequantized: [R, K] float32, dequantize_mxfp4's values (an
    embedding's lookup, without the interchange form between)."""
    elements, row_scales = _fp4_elements(words, scales, index.reshape(-1).long())
    values = e2m1_to_float(elements).view(*row_scales.shape, BLOCK) * scales_to_float(row_scales)[..., None]
    return values.view(elements.shape)


class Bound:
    """A Q4_1 (m given) or Q8_0 weight repacked and checked once: `bound(x, threads)` -> x @ W^T with int8
    activations. The same interface as cpu_gemv.Bound (n, k, kind, tensors, call); `tensors` are the repacked
    ones."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None):
        lib = _library()
        assert lib is not None, "cpu_gemv_i8.available() is False"
        self.k = codes.shape[1] * (2 if m is not None else 1)
        assert self.k % BLOCK == 0 and d.shape == (codes.shape[0], self.k // BLOCK), (codes.shape, d.shape)
        assert codes.dtype == (torch.uint8 if m is not None else torch.int8) and d.dtype == torch.float32
        self.n, self.kind = codes.shape[0], "q4_1" if m is not None else "q8_0"
        self.tensors = repack_q4(codes, d, m) if m is not None else repack_q8(codes, d)
        self._fn = lib.i8_gemm
        self._ptrs = tuple(t.data_ptr() for t in self.tensors) + ((None,) if m is None else ())

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [M, K] float32 contiguous on the CPU -> [M, N] float32."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.k or x.is_cuda:
            raise ValueError(
                f"cpu_gemv_i8: x must be float32 [M, {self.k}] contiguous on the CPU, got {x.dtype} {x.shape}"
            )
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if self._fn(x.shape[0], self.n, self.k, x.data_ptr(), *self._ptrs, y.data_ptr(), threads) != 0:
            raise MemoryError("cpu_gemv_i8: no memory for the quantized activation rows")
        return y


class Fp4Bound:
    """MXFP4 weights of N outputs in repack_fp4's layout (words, scales), checked once: `bound(x, threads)` -> x @ W^T
    (`rotate`: (x R) @ W^T, a RotatedFp4Linear's) with int8 activations. The interface of Bound and cpu_gemv.Bound
    (n, k, kind, rotate, tensors, call); `tensors` are the ones given, held so their pointers stay valid."""

    kind = "mxfp4"

    def __init__(self, words: torch.Tensor, scales: torch.Tensor, n: int, rotate: bool = False):
        lib = _library()
        assert lib is not None and hasattr(lib, "fp4i8_gemm"), "cpu_gemv_i8.available() is False"
        groups, g, lanes = scales.shape
        assert lanes == GROUP and groups == -(-n // GROUP) and scales.dtype == torch.uint8, (scales.shape, n)
        assert words.dtype == torch.uint8 and words.shape == (groups, g, Q4_WORDS, GROUP * 4), words.shape
        assert words.is_contiguous() and scales.is_contiguous() and not words.is_cuda and not scales.is_cuda
        assert not bool((scales == E8M0_NAN).any()), "an MXFP4 block with a NaN scale"
        self.n, self.k, self.rotate = n, g * BLOCK, rotate
        self.tensors = (words, scales)
        self._fn = lib.fp4i8_gemm
        self._ptrs = (words.data_ptr(), scales.data_ptr())

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [M, K] float32 contiguous on the CPU -> [M, N] float32."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.k or x.is_cuda:
            raise ValueError(
                f"cpu_gemv_i8: x must be float32 [M, {self.k}] contiguous on the CPU, got {x.dtype} {x.shape}"
            )
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if self._fn(x.shape[0], self.n, self.k, x.data_ptr(), *self._ptrs, y.data_ptr(), threads, self.rotate):
            raise MemoryError("cpu_gemv_i8: no memory for the quantized activation rows")
        return y


def quantize_rows(x: torch.Tensor, rotate: bool = False) -> tuple[torch.Tensor, ...]:
    """The C quantizer on x [M, K] float32 (`rotate`: x's blocks times R first) -> (xq int8 [M, K], dx,
    dx * sum(xq) float32 [M, K/32], sum(xq) int32)."""
    lib = _library()
    assert lib is not None, "cpu_gemv_i8.available() is False"
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] % BLOCK == 0, x.shape
    m, k = x.shape
    out = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK))
    total = torch.empty(m, k // BLOCK, dtype=torch.int32)
    lib.i8_quantize_rows(m, k, x.data_ptr(), *(t.data_ptr() for t in out), total.data_ptr(), int(rotate))
    return (*out, total)


# --- the plain references -----------------------------------------------------------------------------------
def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] float32 -> (xq int8 [M, K], dx, dx * sum(xq) float32 [M, K/32], sum(xq) int32 [M, K/32])."""
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    dx = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv[..., None])  # torch.round: half to even, as the C kernel's cvtps_epi32
    total = xq.sum(dim=-1).to(torch.int32)  # exact: at most 32 * 127
    return xq.to(torch.int8).view(m, k), dx, dx * total.float(), total


def _combine(isum: torch.Tensor, dw: torch.Tensor, dx: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """isum [M, N, G] exact integer sums -> [M, N]: per block in order, y += (dw * dx) * isum [+ offset]."""
    y = torch.zeros(isum.shape[:2])
    for g in range(isum.shape[2]):
        y = y + (dw[None, :, g] * dx[:, g, None]) * isum[:, :, g]
        if offset is not None:
            y = y + offset[:, :, g]
    return y


def _block_dots(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """xq [M, K], q [N, K] integer codes -> [M, N, G] sums of each block's 32 products, exact (float64: < 2^20)."""
    m, n = xq.shape[0], q.shape[0]
    return torch.einsum("mgj,ngj->mng", xq.double().view(m, -1, BLOCK), q.double().view(n, -1, BLOCK)).float()


def q4_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a GGUF Q4_1 W with int8 activations, as the C kernel computes it."""
    xq, dx, sx, _ = quantize_rows_ref(x)
    return _combine(_block_dots(xq, cpu_gemv.q4_codes(codes, d)), d, dx, m[None, :, :] * sx[:, None, :])


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a GGUF Q8_0 W with int8 activations, as the C kernel computes it."""
    xq, dx, _, _ = quantize_rows_ref(x)
    return _combine(_block_dots(xq, codes), d, dx, None)


def fwht_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 with each block of 32 times R = H_32 / sqrt(32), as the C kernel's fwht32 computes it
    (its butterflies in its order, then the scale, each rounded once: the same bits; mxfp4.rotate_blocks, a matmul,
    rounds otherwise)."""
    v = x.reshape(-1, BLOCK).clone()  # [M * K/32, 32]
    h = 1
    while h < BLOCK:
        pairs = v.view(-1, BLOCK // (2 * h), 2, h)  # [blocks, butterfly groups, (t, t + h), h]
        a, b = pairs[:, :, 0].clone(), pairs[:, :, 1].clone()
        pairs[:, :, 0], pairs[:, :, 1] = a + b, a - b
        h *= 2
    return (v * torch.tensor(0.17677669529663687, dtype=torch.float32)).view(x.shape)


def e8m0_ref(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes e (uint8, none 0xFF) -> float32 with exponent bits e: 2^(e - 127), and 0.0 for e = 0 (the kernel's
    reading: the exact 2^-127 is a float32 subnormal; mxfp4.scales_to_float gives it)."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


def fp4_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, rotate: bool = False) -> torch.Tensor:
    """x [M, K] float32 @ W^T for an MXFP4 W (interchange codes / scales, no NaN block) with int8 activations, as
    the C kernel computes it: per block sum_j (2 e2m1(c_j)) xq_j (exact integers), then y += (2^(e - 127) * (dx / 2))
    * that sum over the blocks in order. `rotate`: x's blocks times R first (fwht_ref)."""
    _check_fp4(codes, scales)
    xq, dx, _, _ = quantize_rows_ref(fwht_ref(x) if rotate else x)
    twice = 2 * e2m1_to_float(unpack_nibbles(codes))  # [N, K]: integers -12..12
    return _combine(_block_dots(xq, twice), e8m0_ref(scales), dx * 0.5, None)
