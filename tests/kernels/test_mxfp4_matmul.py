"""MXFP4 matmul: the Triton kernels against the torch reference, the prepared layout, the CPU scratch path.

The kernel tests run on CUDA (the fast bf16 path included), or on CPU under TRITON_INTERPRET=1 (the portable
path: the interpreter has no inline assembly and its bf16 tl.dot is wrong). Triton reads that variable when a
kernel is defined, so on a CPU-only machine `test_kernels_under_interpreter` reruns this file in a subprocess
with it set.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from specchat.kernels.mxfp4_matmul import (
    MAX_M,
    DequantScratch,
    MatmulConfig,
    Mxfp4Weight,
    choose_config,
    mxfp4_linear,
    mxfp4_matmul_triton,
    prepare_weight,
    quantize_mxfp4_triton,
    unprepare_weight,
)
from tests.kernels.interpreter import DEVICE, INTERPRET, kernel_test, run_under_interpreter, subprocess_test


def random_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] weight with block scales spread over 2^-10..2^2 (above 2: an exponent offset), codes, scales."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * torch.logspace(-10, 2, n, base=2.0)[:, None]
    return (w, *quantize_mxfp4(w))


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    return x.double() @ dequantize_mxfp4(codes, scales, k=k).double().T


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()


@subprocess_test
def test_kernels_under_interpreter() -> None:
    run_under_interpreter([__file__], "not under_interpreter")


# ------------------------------------------------------------------------------------------------ layout, CPU


@pytest.mark.parametrize(("n", "k"), [(67, 256), (130, 96), (64, 1000)])
def test_kernel_layout_round_trips(n: int, k: int) -> None:
    _, codes, scales = random_weight(n, k)
    weight = prepare_weight(codes, scales, k, layout="kernel")
    assert weight.prepared and not weight.has_nan
    assert weight.codes.shape[2:] == (64, 16) and weight.codes.shape[1] == -(-k // 128)
    back_codes, back_scales = unprepare_weight(weight)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


def test_kernel_layout_records_nan_blocks_and_large_scales() -> None:
    w = torch.randn(64, 256)
    w[1, 3] = float("nan")
    w[2, 32:64] *= 2.0**40  # block scale 2^38 > 2: the kernel needs an exponent offset
    codes, scales = quantize_mxfp4(w)
    weight = prepare_weight(codes, scales, layout="kernel")
    assert weight.has_nan and weight.exp_offset == int(scales[scales != 0xFF].max()) - 128
    assert all(torch.equal(a, b) for a, b in zip(unprepare_weight(weight), (codes, scales), strict=True))


def test_cpu_linear_is_f_linear_on_dequantized_weights() -> None:
    _, codes, scales = random_weight(67, 200)
    weight = prepare_weight(codes, scales, 200)  # CPU: the plain layout
    assert not weight.prepared and weight.nbytes == codes.numel() + scales.numel()
    dense = dequantize_mxfp4(codes, scales, k=200)
    x, bias = torch.randn(2, 3, 200), torch.randn(67)
    assert torch.equal(mxfp4_linear(x, weight, bias), F.linear(x, dense, bias))
    xb = x.to(torch.bfloat16)
    assert torch.equal(mxfp4_linear(xb, weight), F.linear(xb, dense.to(torch.bfloat16)))


def test_layers_share_one_scratch_buffer() -> None:
    scratch = DequantScratch()
    small = prepare_weight(*random_weight(32, 64)[1:])
    large = prepare_weight(*random_weight(96, 128)[1:])
    x64, x128 = torch.randn(1, 64), torch.randn(1, 128)
    first = mxfp4_linear(x128, large, scratch=scratch)
    mxfp4_linear(x64, small, scratch=scratch)
    assert scratch.nbytes == 96 * 128 * 4  # the largest layer, once
    assert torch.equal(mxfp4_linear(x128, large, scratch=scratch), first)


def test_choose_config_keeps_splits_busy() -> None:
    for n, k in [(4096, 4096), (4096, 14336), (128256, 4096), (576, 576)]:
        k_tiles = -(-k // 128)
        words = torch.empty(1, k_tiles, 64, 16, dtype=torch.int32).expand(-(-n // 128) * 2, -1, -1, -1)
        weight = Mxfp4Weight(n, k, words, torch.empty(0, dtype=torch.uint8), prepared=True)
        for m in (1, 16, 64):
            config = choose_config(m, weight)
            assert k_tiles % config.tiles == 0 and k_tiles // (config.tiles * config.split_k) >= 1, (n, k, m)
            assert config.block_n == (128 if n >= 16384 else 64)


# ------------------------------------------------------------------------------------------------ kernels


@kernel_test
@pytest.mark.parametrize(("m", "n", "k"), [(1, 67, 256), (5, 131, 96), (17, 67, 384)])
def test_matmul_matches_reference(m: int, n: int, k: int) -> None:
    _, codes, scales = random_weight(n, k, seed=m)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), k, layout="kernel")
    x = torch.randn(m, k)
    ref = reference(x, codes, scales, k)
    y = mxfp4_matmul_triton(x.to(DEVICE), weight)  # float32: the portable path, float32 sums
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_error(y, ref) < 1e-5
    xb = x.to(torch.bfloat16)
    yb = mxfp4_matmul_triton(xb.to(DEVICE), weight)  # CUDA: the fast path; interpreter: portable
    assert yb.dtype == torch.bfloat16 and relative_error(yb, reference(xb.float(), codes, scales, k)) < 8e-3


@kernel_test
def test_split_k_and_row_chunks() -> None:
    _, codes, scales = random_weight(67, 1024)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    x = torch.randn(MAX_M + 6, 1024)  # two launches: 64 rows, then 6
    ref = reference(x, codes, scales, 1024)
    for config in (
        MatmulConfig(tiles=2, split_k=1),
        MatmulConfig(tiles=2, split_k=4),
        MatmulConfig(tiles=1, split_k=3),
    ):
        for _ in range(2):  # the arrival counters reset for the next launch
            assert relative_error(mxfp4_matmul_triton(x.to(DEVICE), weight, config), ref) < 1e-5, config


@kernel_test
def test_matmul_nan_blocks_and_exponent_offset() -> None:
    w = torch.randn(67, 256)
    w[3, 40] = float("nan")  # row 3, block 1
    w[5, 64:96] *= 2.0**60  # scale 2^58: offset c > 0
    w[6, :32] *= 2.0**-60  # far below, still within 2^125 of the largest block
    codes, scales = quantize_mxfp4(w)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    assert weight.has_nan and weight.exp_offset > 0
    x = torch.randn(2, 256)
    y, ref = mxfp4_matmul_triton(x.to(DEVICE), weight).cpu(), reference(x, codes, scales, 256)
    assert torch.equal(y.isnan(), ref.isnan()) and y[:, 3].isnan().all()
    finite = ~ref.isnan()
    assert relative_error(y[finite], ref[finite]) < 1e-5
    assert relative_error(y[:, 6], ref[:, 6]) < 1e-5  # the small row, next to the huge one


@kernel_test
def test_float16_activations() -> None:
    _, codes, scales = random_weight(64, 128)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    x = torch.randn(3, 128, dtype=torch.float16)
    y = mxfp4_matmul_triton(x.to(DEVICE), weight)
    assert y.dtype == torch.float16 and relative_error(y, reference(x.float(), codes, scales, 128)) < 2e-3


@kernel_test
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter on the NaN/Inf blocks
@pytest.mark.parametrize("rule", ["ocp", "roundup"])
def test_quantize_kernel_is_bit_exact(rule: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 333) * torch.logspace(-44, 37, 37)[:, None]  # subnormal to huge rows
    x[3, 5], x[4, 100], x[5, 40:72], x[6, 0] = float("nan"), float("-inf"), 0.0, -0.0
    x[7, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4)  # ties and saturation
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    for dtype in dtypes:
        xd = x.to(dtype)
        if dtype == torch.bfloat16 and INTERPRET:  # the interpreter reads bf16 subnormals wrongly
            xd = torch.where(xd.abs() < torch.finfo(dtype).tiny, torch.zeros_like(xd), xd)
        codes, scales = quantize_mxfp4_triton(xd.to(DEVICE), rule)
        ref_codes, ref_scales = quantize_mxfp4(xd, rule)
        assert torch.equal(codes.cpu(), ref_codes) and torch.equal(scales.cpu(), ref_scales), dtype
