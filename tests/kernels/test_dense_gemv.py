"""The dense GEMV (kernels/dense_gemv_triton.py) against F.linear, and its gated form against silu_mul of the plain
one.

Kernel tests run on CUDA, or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file in
a subprocess with it set; the interpreter has no bf16, so there the tests take float16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specchat.kernels.dense_gemv import MAX_ROWS, GemvConfig, choose_config, supported
from specchat.kernels.dense_gemv_triton import dense_gemv
from specchat.kernels.fused_triton import silu_mul
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# (rows, n, k): the default model's shapes (576 wide), ragged n and k, one row to a full tile
SHAPES = [(1, 960, 576), (3, 576, 1536), (16, 200, 576), (5, 64, 100), (2, 17, 33)]


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    return x, w


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear in float32, rounded once to x's dtype."""
    return F.linear(x.float(), w.float()).to(x.dtype)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemv_equals_the_linear_within_rounding(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w = operands(m, n, k, dtype)
    got = dense_gemv(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    # the sums run in float32 in another order: at most one rounding step of the output apart
    torch.testing.assert_close(got.float(), reference(x, w).float(), atol=2e-3, rtol=8e-3)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES[:3])
def test_gated_gemv_equals_silu_mul_of_the_plain_one(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w = operands(m, 2 * n, k, dtype, seed=1)
    got = dense_gemv(x, w, gated=True)
    assert got.shape == (m, n)
    # the same launch sums in the same order: the same values, combined alike
    launch = choose_config(n, k, gated=True, m=m)
    assert torch.equal(got, silu_mul(dense_gemv(x, w, config=launch)))
    gate, up = reference(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(got.float(), (F.silu(gate) * up), atol=4e-3, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("config", [GemvConfig(16, 32), GemvConfig(32, 64, num_warps=2), GemvConfig(64, 128)])
def test_every_launch_config_gives_the_same_result(config: GemvConfig) -> None:
    x, w = operands(4, 300, 576, torch.float16, seed=2)
    torch.testing.assert_close(dense_gemv(x, w, config=config).float(), reference(x, w).float(), atol=2e-3, rtol=8e-3)


@kernel_test
@pytest.mark.parametrize("gated", [False, True])
def test_a_bias_is_added_before_the_rounding(gated: bool) -> None:
    x, w = operands(3, 96, 64, torch.float16, seed=4)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(5)).to(torch.float16).to(DEVICE)
    got = dense_gemv(x, w, bias, gated=gated)
    want = F.linear(x.float(), w.float(), bias.float()).to(x.dtype)
    if gated:
        assert torch.equal(got, silu_mul(dense_gemv(x, w, bias, config=choose_config(48, 64, gated=True, m=3))))
        gate, up = want.float().chunk(2, dim=-1)
        want = (F.silu(gate) * up).to(x.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES[:3])
def test_the_silu_epilogue_is_silu_of_the_plain_output(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """`act`: F.silu of the rounded output (the draft heads' W_up), bit for bit where the launch is the same."""
    x, w = operands(m, n, k, dtype, seed=6)
    got = dense_gemv(x, w, act=True)
    plain = dense_gemv(x, w)
    # (another exp: at most the last bit apart)
    torch.testing.assert_close(got, F.silu(plain.float()).to(dtype), atol=0, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(got.float(), F.silu(reference(x, w).float()), atol=4e-3, rtol=2e-2)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES[:3])
def test_a_residual_is_added_before_the_rounding_as_addmm_adds_it(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """`residual`: the draft heads' W_down with their state added, one rounding of the float32 sum."""
    x, w = operands(m, n, k, dtype, seed=7)
    residual = (torch.randn(m, n, generator=torch.Generator().manual_seed(8)) * 4).to(dtype).to(DEVICE)
    before = residual.clone()
    got = dense_gemv(x, w, residual=residual)
    want = (F.linear(x.float(), w.float()) + before.float()).to(dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=8e-3)
    assert not torch.equal(got, dense_gemv(x, w)) and torch.equal(residual, before)  # (read, not written)
    with pytest.raises(AssertionError, match="gated"):
        dense_gemv(x, torch.cat([w, w]), gated=True, residual=residual)


@kernel_test
def test_leading_dims_are_kept() -> None:
    x, w = operands(6, 48, 64, torch.float16, seed=3)
    assert torch.equal(dense_gemv(x.view(2, 3, 64), w), dense_gemv(x, w).view(2, 3, 48))


@kernel_test
def test_what_it_takes() -> None:
    x = torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(32, 64, dtype=torch.float16, device=DEVICE)
    assert supported(x[:MAX_ROWS], w) and supported(x[:1], w)
    assert not supported(x, w)  # more rows than one tile: cuBLAS
    assert not supported(x[:2].float(), w.float())  # float32 stays with F.linear
    assert not supported(x[:2], w.t().contiguous().t())  # a transposed weight view


@subprocess_test
def test_kernels_under_interpreter() -> None:
    run_under_interpreter([__file__], "not interpreter")
