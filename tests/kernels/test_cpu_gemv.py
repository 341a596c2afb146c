"""The CPU block kernels (kernels/cpu_gemv.py) against their torch references and gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specchat.kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler for the CPU kernels")

N, K = 96, 320  # 10 blocks of 32 per row


def q4_weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.02).half().float()  # GGUF's scales are float16
    m = (-torch.rand(N, K // 32, generator=g) * 0.1).half().float()
    return codes, d, m


def q8_weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    return codes, (torch.rand(N, K // 32, generator=g) * 0.01).half().float()


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


def test_dequantize_is_gguf_reference():
    """The layouts read GGUF's Q4_1 / Q8_0 blocks: the torch dequantization equals gguf's, bit for bit."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from specchat.engine.cpu_weights import _q4_1, _q8_0

    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    for kind, read, deq in ((Q.Q4_1, _q4_1, cpu_gemv.q4_dequantize), (Q.Q8_0, _q8_0, cpu_gemv.q8_dequantize)):
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
