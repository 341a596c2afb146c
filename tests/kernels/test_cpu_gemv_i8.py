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
    return tuple(t[:n].contiguous() for t in q4_weights(seed))


def q8(seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    return tuple(t[:n].contiguous() for t in q8_weights(seed))


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
def test_q4_equals_reference_bit_for_bit(m, threads):
    """The reference does the same integer sums and the same float operations in the same order."""
    codes, d, m_ = q4(m)
    x = rows(m, 1)
    assert torch.equal(cpu_gemv_i8.Bound(codes, d, m_)(x, threads), cpu_gemv_i8.q4_linear_ref(x, codes, d, m_))


@pytest.mark.parametrize("m", [1, 5, 17, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_equals_reference_bit_for_bit(m, threads):
    codes, d = q8(m)
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
