"""The CPU block kernels (kernels/cpu_gemv.py) against their torch references and gguf's own dequantization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specchat.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler for the CPU kernels")

N, K = 96, 320  # 10 blocks of 32 per row
BLOCK = cpu_gemv.BLOCK


def q4_weights(seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, K // 32, generator=g) * 0.02).half().float()  # GGUF's scales are float16
    m = (-torch.rand(n, K // 32, generator=g) * 0.1).half().float()
    return codes, d, m


def q8_weights(seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, K), dtype=torch.int8, generator=g)
    return codes, (torch.rand(n, K // 32, generator=g) * 0.01).half().float()


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("threads", [1, 2])
def test_q4_matches_reference(rows, threads):
    codes, d, m = q4_weights(rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    got = cpu_gemv.q4_linear(x, codes, d, m, threads)
    torch.testing.assert_close(got, cpu_gemv.q4_linear_ref(x, codes, d, m), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_matches_reference(rows, threads):
    codes, d = q8_weights(rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(2))
    got = cpu_gemv.q8_linear(x, codes, d, threads)
    torch.testing.assert_close(got, cpu_gemv.q8_linear_ref(x, codes, d), rtol=1e-5, atol=1e-5)


def test_rows_do_not_depend_on_the_batch():
    """A token's output is bit-identical alone and in a verification batch: lossless speculation stays exact."""
    codes, d, m = q4_weights(3)
    q8, d8 = q8_weights(3)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(3))
    batch4, batch8 = cpu_gemv.q4_linear(x, codes, d, m, 2), cpu_gemv.q8_linear(x, q8, d8, 2)
    for i in range(9):
        row = x[i : i + 1].contiguous()
        assert torch.equal(cpu_gemv.q4_linear(row, codes, d, m, 1)[0], batch4[i])
        assert torch.equal(cpu_gemv.q8_linear(row, q8, d8, 1)[0], batch8[i])


@pytest.mark.parametrize("n", [96, 7])  # 7: the wider tiles' leftover outputs
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_matches_reference_and_rows_do_not_depend_on_the_batch(n, threads):
    """bfloat16 weights widened in registers: float32 sums close to the reference, and each row's bits the same
    alone as in any batch (every tile shape of 1-8 rows, and chunks of 8 above)."""
    g = torch.Generator().manual_seed(n)
    weight = torch.randn(n, K, generator=g).bfloat16()
    x = torch.randn(20, K, generator=g)
    bound = cpu_gemv.Bound(weight)
    assert bound.k == K and bound.n == n and bound.tensors[0] is weight
    alone = torch.cat([cpu_gemv.bf16_linear(x[i : i + 1], weight, 1) for i in range(20)])
    torch.testing.assert_close(alone, cpu_gemv.bf16_linear_ref(x, weight), rtol=1e-5, atol=1e-5)
    for rows in range(1, 21):
        assert torch.equal(cpu_gemv.bf16_linear(x[:rows], weight, threads), alone[:rows])
        assert torch.equal(bound(x[:rows].contiguous(), threads), alone[:rows])


def mxfp4_weights(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from specchat.kernels.mxfp4 import quantize_mxfp4

    g = torch.Generator().manual_seed(seed)
    spread = torch.rand(n, K // BLOCK, generator=g).repeat_interleave(BLOCK, 1) * 4  # blocks of other scales
    weight = torch.randn(n, K, generator=g) * spread
    weight[0, :BLOCK] = 0.0  # an all-zero block: scale code 0, the subnormal 2^-127
    codes, scales = quantize_mxfp4(weight)
    assert int(scales[0, 0]) == 0
    return codes, scales


@pytest.mark.parametrize("n", [96, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_mxfp4_matches_reference_and_rows_do_not_depend_on_the_batch(n, threads):
    """MXFP4 codes read as stored: close to the dequantized reference, each row's bits the same in any batch."""
    codes, scales = mxfp4_weights(n, n)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([cpu_gemv.fp4_linear(x[i : i + 1], codes, scales, 1) for i in range(20)])
    torch.testing.assert_close(alone, cpu_gemv.fp4_linear_ref(x, codes, scales), rtol=1e-5, atol=1e-4)
    bound = cpu_gemv.Bound(codes, scales)
    for rows in range(1, 21):
        assert torch.equal(bound(x[:rows].contiguous(), threads), alone[:rows])
    rotated = cpu_gemv.fp4_linear(x, codes, scales, threads, rotate=True)  # (x R) W^T: the rotation in C
    want = cpu_gemv.fp4_linear_ref(x, codes, scales, rotate=True)
    torch.testing.assert_close(rotated, want, rtol=1e-5, atol=1e-4)
    with pytest.raises(AssertionError, match="NaN scale"):
        cpu_gemv.Bound(codes, torch.where(scales == scales[1, 1], 0xFF, scales).to(torch.uint8))


@pytest.mark.parametrize(
    "flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma")], ids=["avx2", "plain-c"]
)
def test_bf16_and_mxfp4_kernels_of_the_other_builds(flags):
    """The AVX2 + FMA build and the plain C one (what CPUs without AVX-512 run) against the references."""
    from specchat.kernels import cpu_build

    cpuinfo = Path("/proc/cpuinfo")
    host = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if "-mno-avx2" not in flags and not ("avx2" in host and "fma" in host):
        pytest.skip("this CPU cannot run the AVX2 build")
    lib = cpu_build.load("cpu_gemv_test_" + flags[-1].strip("-"), cpu_gemv.C_SOURCE, (*cpu_gemv.CFLAGS, *flags))
    if lib is None:
        pytest.skip("no C compiler")
    cpu_gemv.declare(lib)
    codes, scales = mxfp4_weights(7, 3)
    weight = torch.randn(7, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(6))
    for rows in (1, 2, 3, 5, 9):
        xs = x[:rows].contiguous()
        fp4, bf16 = torch.empty(rows, 7), torch.empty(rows, 7)
        lib.bf16_gemm(rows, 7, K, *(t.data_ptr() for t in (xs, weight, bf16)), 2)
        torch.testing.assert_close(bf16, cpu_gemv.bf16_linear_ref(xs, weight), rtol=1e-5, atol=1e-4)
        for rotate in (0, 1):
            assert lib.fp4_gemm(rows, 7, K, *(t.data_ptr() for t in (xs, codes, scales, fp4)), 2, rotate) == 0
            want = cpu_gemv.fp4_linear_ref(xs, codes, scales, rotate=bool(rotate))
            torch.testing.assert_close(fp4, want, rtol=1e-5, atol=1e-4)


def test_dequantize_is_gguf_reference():
    """The layouts read GGUF's Q4_1 / Q8_0 blocks: the torch dequantization equals gguf's, bit for bit."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from specchat.engine.gguf_file import q4_1_arrays, q8_0_arrays

    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    for kind, read, deq in (
        (Q.Q4_1, q4_1_arrays, cpu_gemv.q4_dequantize),
        (Q.Q8_0, q8_0_arrays, cpu_gemv.q8_dequantize),
    ):
        raw = quantize(w, kind)
        expected = torch.from_numpy(np.asarray(dequantize(raw, kind), dtype=np.float32)).view(N, K)
        assert torch.equal(deq(*read(raw, N)), expected)


def test_bound_weight_equals_the_plain_call():
    """cpu_gemv.Bound (the weight checked and its pointers taken once) gives the plain calls' bits."""
    codes, d, m = q4_weights(4)
    q8, d8 = q8_weights(4)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    assert torch.equal(cpu_gemv.Bound(codes, d, m)(x, 1), cpu_gemv.q4_linear(x, codes, d, m, 1))
    assert torch.equal(cpu_gemv.Bound(q8, d8)(x, 2), cpu_gemv.q8_linear(x, q8, d8, 2))
    with pytest.raises(ValueError):
        cpu_gemv.Bound(q8, d8)(x[:, :-32].contiguous(), 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_dequantize_as_gguf(threads):
    """One-hot activation rows read the kernels' in-register weights out exactly: x = I gives W^T, bit for bit
    equal to the reference dequantization (1 * w + zeros is w), the rounding of gguf's d * q + m included."""
    eye = torch.eye(K)
    for seed in range(3):
        codes, d, m = q4_weights(seed)
        assert torch.equal(cpu_gemv.q4_linear(eye, codes, d, m, threads), cpu_gemv.q4_dequantize(codes, d, m).T)
        q8, d8 = q8_weights(seed)
        assert torch.equal(cpu_gemv.q8_linear(eye, q8, d8, threads), cpu_gemv.q8_dequantize(q8, d8).T)
