"""The int8-activation CPU kernels (kernels/cpu_gemv_i8.py) against their torch reference, exact integer cases and
the float-activation kernels."""

from __future__ import annotations

import pytest
import torch

from specchat.kernels import cpu_gemv, cpu_gemv_i8
from tests.kernels.test_cpu_gemv import q4_weights, q8_weights

pytestmark = pytest.mark.skipif(not cpu_gemv_i8.available(), reason="no C compiler or no AVX512-VNNI or AVX2")

N, K = 100, 320  # 10 blocks of 32 per row; 100 outputs = 6 groups of 16 and a partial one of 4


def q4(seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    return q4_weights(seed, n)


def q8(seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    return q8_weights(seed, n)


def rows(m: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: scale 0, every code 0
    return x


def test_quantized_rows_equal_the_reference():
    x = rows(7, 0)
    got, ref = cpu_gemv_i8.quantize_rows(x), cpu_gemv_i8.quantize_rows_ref(x)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert got[0][0, :32].eq(0).all() and got[1][0, 0] == 0


def test_quantization_rounds_half_to_even():
    """A block whose largest |x| is 127 has scale 1: x itself, rounded half to even, is the code."""
    x = torch.zeros(1, 32)
    x[0, :7] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5])
    xq, dx, sx, total = cpu_gemv_i8.quantize_rows(x)
    assert xq[0, :7].tolist() == [127, 0, 2, 2, 0, -2, -126] and dx.item() == 1.0
    assert total.item() == 3 and sx.item() == 3.0


@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 20, 40])  # 40: the threads quantize the rows too
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [N, 96])  # 96: whole groups of 16 (the repack's path without padding)
def test_q4_equals_reference_bit_for_bit(m, threads, n):
    """The reference does the same integer sums and the same float operations in the same order."""
    codes, d, m_ = q4(m, n)
    x = rows(m, 1)
    assert torch.equal(cpu_gemv_i8.Bound(codes, d, m_)(x, threads), cpu_gemv_i8.q4_linear_ref(x, codes, d, m_))


@pytest.mark.parametrize("m", [1, 5, 17, 33])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [N, 96])
def test_q8_equals_reference_bit_for_bit(m, threads, n):
    codes, d = q8(m, n)
    x = rows(m, 2)
    assert torch.equal(cpu_gemv_i8.Bound(codes, d)(x, threads), cpu_gemv_i8.q8_linear_ref(x, codes, d))


def test_integer_part_is_exact():
    """Integer activations with a 127 in every block (scale 1), weight scales 1 and offsets 0: the output is the
    exact integer product, which float32 holds (< 2^24)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-127, 128, (5, K), generator=g).float()
    x[:, ::32] = 127.0
    ones = torch.ones(N, K // 32)
    codes4 = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    codes8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    q4_exact = x.double() @ cpu_gemv.q4_dequantize(codes4, ones, 0 * ones).double().T
    q8_exact = x.double() @ codes8.double().T
    assert torch.equal(cpu_gemv_i8.Bound(codes4, ones, 0 * ones)(x, 1).double(), q4_exact)
    assert torch.equal(cpu_gemv_i8.Bound(codes8, ones)(x, 2).double(), q8_exact)


def test_rows_do_not_depend_on_the_batch():
    """A token's output is bit-identical alone and in a 5-row or 9-row batch: lossless speculation stays exact."""
    w4, w8 = cpu_gemv_i8.Bound(*q4(4)), cpu_gemv_i8.Bound(*q8(4))
    for m in (5, 9):
        x = rows(m, 4)
        batch4, batch8 = w4(x, 2), w8(x, 2)
        for i in range(m):
            row = x[i : i + 1].contiguous()
            assert torch.equal(w4(row, 1)[0], batch4[i]) and torch.equal(w8(row, 1)[0], batch8[i])


def test_close_to_float_activations():
    """8-bit activations per block of 32 cost well under 1% of the output's norm on random rows (a wrong nibble,
    word or lane order would cost ~100%)."""
    x = rows(5, 5)
    codes, d, m = q4(5)
    q8c, d8 = q8(5)
    for got, exact in (
        (cpu_gemv_i8.Bound(codes, d, m)(x, 1), cpu_gemv.q4_linear_ref(x, codes, d, m)),
        (cpu_gemv_i8.Bound(q8c, d8)(x, 1), cpu_gemv.q8_linear_ref(x, q8c, d8)),
    ):
        assert (got - exact).norm() / exact.norm() < 0.01


def test_bad_rows_raise():
    bound = cpu_gemv_i8.Bound(*q8(6))
    with pytest.raises(ValueError, match="float32"):
        bound(torch.randn(2, K).double(), 1)
    with pytest.raises(ValueError, match="contiguous"):
        bound(torch.randn(K, 2).T, 1)


# --- MXFP4 weights ---------------------------------------------------------------------------------------------
def fp4(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and scales [n, K]: blocks of other scales, an all-zero block (scale code 0), and a block
    too small for E8M0's range (scale code 0 with nonzero codes: the int8 kernel and its reference read 2^-127 as
    0)."""
    from specchat.kernels.mxfp4 import quantize_mxfp4

    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(n, K // 32, generator=g).repeat_interleave(32, 1) * 4
    weight = torch.randn(n, K, generator=g) * spread
    weight[0, :32] = 0.0
    weight[n - 1, 64:96] *= 1e-39  # below 2^-125
    codes, scales = quantize_mxfp4(weight)
    assert int(scales[0, 0]) == 0 and int(scales[n - 1, 2]) == 0 and bool(codes[n - 1, 32:48].ne(0).any())
    return codes, scales


def fp4_bound(codes: torch.Tensor, scales: torch.Tensor, rotate: bool = False) -> cpu_gemv_i8.Fp4Bound:
    return cpu_gemv_i8.Fp4Bound(*cpu_gemv_i8.repack_fp4(codes, scales), codes.shape[0], rotate=rotate)


@pytest.mark.parametrize("n", [N, 7])  # N: 6 groups of 16 and a partial one; 7: one partial group
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rotate", [False, True])
def test_fp4_equals_reference_bit_for_bit(n, threads, rotate):
    """1-9 rows (every tile shape and a second chunk) and 40 (the threads quantize the rows too): the kernel's bits
    are fp4_linear_ref's, the block rotation in C included."""
    codes, scales = fp4(n, n)
    bound = fp4_bound(codes, scales, rotate)
    for m in (*range(1, 10), 40):
        x = rows(m, m)
        assert torch.equal(bound(x, threads), cpu_gemv_i8.fp4_linear_ref(x, codes, scales, rotate)), m


def test_fp4_rows_do_not_depend_on_the_batch():
    codes, scales = fp4(N, 1)
    for rotate in (False, True):
        bound = fp4_bound(codes, scales, rotate)
        x = rows(9, 3)
        batch = bound(x, 2)
        for i in range(9):
            assert torch.equal(bound(x[i : i + 1].contiguous(), 1)[0], batch[i])


def test_rotated_rows_quantize_as_the_reference():
    """The C rotation (butterflies) equals fwht_ref bit for bit, and both are mxfp4.rotate_blocks up to rounding."""
    from specchat.kernels.mxfp4 import rotate_blocks

    x = rows(5, 7)
    got, ref = cpu_gemv_i8.quantize_rows(x, rotate=True), cpu_gemv_i8.quantize_rows_ref(cpu_gemv_i8.fwht_ref(x))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    torch.testing.assert_close(cpu_gemv_i8.fwht_ref(x), rotate_blocks(x), rtol=1e-5, atol=1e-5)


def test_fp4_integer_part_is_exact():
    """Integer activations with a 127 in every block (dx = 1) and scale 2^0: the output is the exact product of x
    and the E2M1 values (half-integers), which float32 holds."""
    from specchat.kernels.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(8)
    x = torch.randint(-127, 128, (5, K), generator=g).float()
    x[:, ::32] = 127.0
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    scales = torch.full((N, K // 32), 127, dtype=torch.uint8)
    exact = x.double() @ dequantize_mxfp4(codes, scales).double().T
    assert torch.equal(fp4_bound(codes, scales)(x, 2).double(), exact)


def test_fp4_close_to_float_activations():
    """8-bit rows cost well under 1% of the output's norm (a wrong nibble, lane or table entry would cost ~100%)."""
    codes, scales = fp4(N, 4)
    x = rows(5, 5)
    for rotate in (False, True):
        exact = cpu_gemv.fp4_linear_ref(x, codes, scales, rotate)
        assert (fp4_bound(codes, scales, rotate)(x, 1) - exact).norm() / exact.norm() < 0.01


def test_fp4_repack_holds_the_same_bytes_and_unpacks_exactly():
    from specchat.kernels.mxfp4 import dequantize_mxfp4

    codes, scales = fp4(N, 5)
    words, packed_scales = cpu_gemv_i8.repack_fp4(codes, scales)
    groups = -(-N // 16)
    assert words.numel() == groups * 16 * K // 2 and packed_scales.numel() == groups * 16 * K // 32
    back = cpu_gemv_i8.unpack_fp4(words, packed_scales, N)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales)
    index = torch.tensor([[99, 0], [17, 17]])
    picked = cpu_gemv_i8.fp4_rows(words, packed_scales, index)
    assert torch.equal(picked, dequantize_mxfp4(codes, scales)[index.flatten()])


def test_fp4_nan_scale_is_refused():
    codes, scales = fp4(N, 6)
    scales[3, 4] = 0xFF
    with pytest.raises(ValueError, match="NaN scale"):
        cpu_gemv_i8.repack_fp4(codes, scales)
    with pytest.raises(ValueError, match="NaN scale"):
        cpu_gemv_i8.fp4_linear_ref(rows(1, 0), codes, scales)


def test_the_avx2_build_gives_the_same_bits():
    """The AVX2 build (maddubs + madd for dpbusd: what CPUs without AVX512-VNNI run) against the references: Q4_1,
    Q8_0 and MXFP4 (rotated and not), 1-9 rows (its tiles of up to 5 and a second pass), 1 and 2 threads."""
    from pathlib import Path

    from specchat.kernels import cpu_build

    cpuinfo = Path("/proc/cpuinfo")
    host = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if not all(flag in host for flag in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run the AVX2 build")
    lib = cpu_build.load("cpu_gemv_i8_test_avx2", cpu_gemv_i8.C_SOURCE, (*cpu_gemv.CFLAGS, "-mno-avx512f"))
    lib = lib and cpu_gemv_i8.bind(lib)
    if lib is None:
        pytest.skip("no C compiler")
    q4w, q8w, (codes, scales) = q4(7), q8(7), fp4(N, 7)
    q4p, q8p, fp4p = cpu_gemv_i8.repack_q4(*q4w), cpu_gemv_i8.repack_q8(*q8w), cpu_gemv_i8.repack_fp4(codes, scales)
    for m in range(1, 10):
        x = rows(m, 10 + m)
        for threads in (1, 2):
            n = q4w[0].shape[0]
            y4, y8, yf = torch.empty(m, n), torch.empty(m, n), torch.empty(m, N)
            assert lib.i8_gemm(m, n, K, x.data_ptr(), *(t.data_ptr() for t in q4p), y4.data_ptr(), threads) == 0
            assert lib.i8_gemm(m, n, K, x.data_ptr(), *(t.data_ptr() for t in q8p), None, y8.data_ptr(), threads) == 0
            assert torch.equal(y4, cpu_gemv_i8.q4_linear_ref(x, *q4w))
            assert torch.equal(y8, cpu_gemv_i8.q8_linear_ref(x, *q8w))
            for rotate in (0, 1):
                ptrs = (x.data_ptr(), *(t.data_ptr() for t in fp4p), yf.data_ptr())
                assert lib.fp4i8_gemm(m, N, K, *ptrs, threads, rotate) == 0
                assert torch.equal(yf, cpu_gemv_i8.fp4_linear_ref(x, codes, scales, bool(rotate))), (m, rotate)
