"""The Triton MXFP4 matmul against the torch reference, and the launches it chooses.

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
from specchat.kernels.mxfp4_dequant import DequantScratch
from specchat.kernels.mxfp4_dequant_triton import dequantize_prepared_into
from specchat.kernels.mxfp4_layout import Mxfp4Weight, prepare_weight
from specchat.kernels.mxfp4_matmul import DENSE_MIN_ROWS, dequantized_linear, mxfp4_linear
from specchat.kernels.mxfp4_matmul_kernel import (
    MAX_BLOCK_M,
    MAX_SPLIT_K,
    MatmulConfig,
    choose_config,
    default_block_m,
    mxfp4_matmul_triton,
)
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test
from tests.kernels.mxfp4_weights import random_weight, reference, relative_error


@subprocess_test
def test_kernels_under_interpreter() -> None:
    run_under_interpreter([__file__], "not under_interpreter")


def test_choose_config_keeps_splits_busy() -> None:
    for n, k in [(4096, 4096), (4096, 14336), (128256, 4096), (576, 576)]:
        k_tiles = -(-k // 128)
        words = torch.empty(1, k_tiles, 64, 16, dtype=torch.int32).expand(-(-n // 128) * 2, -1, -1, -1)
        weight = Mxfp4Weight(n, k, words, torch.empty(0, dtype=torch.uint8), prepared=True)
        for m in (1, 16, 64, 160):
            config = choose_config(m, weight)
            assert k_tiles % config.tiles == 0 and k_tiles // (config.tiles * config.split_k) >= 1, (n, k, m)
            big = n >= 16384 or (k >= 8192 and m > 64)  # long K takes the wide weights' programs above M = 64
            assert config.block_n == (128 if big and m != 64 else 64)


def test_choose_config_decodes_a_verification_batch_at_most_twice() -> None:
    """M = 129..192 (e.g. 32 sessions verifying 4 drafts: 160 rows): each program multiplies the weights it
    decoded by all its rows, two M tiles at most, one for wide or long weights."""
    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]:
        k_tiles = -(-k // 128)
        words = torch.empty(1, k_tiles, 64, 16, dtype=torch.int32).expand(-(-n // 128) * 2, -1, -1, -1)
        weight = Mxfp4Weight(n, k, words, torch.empty(0, dtype=torch.uint8), prepared=True)
        for m in (129, 160, 192):
            config = choose_config(m, weight)
            rows = config.block_m + config.extra_m
            assert config.extra_m > 0 and -(-m // rows) == (1 if n >= 16384 or k >= 8192 else 2), (n, k, m, config)
            assert config.tiles == 1 and config.split_k <= 4 and k_tiles // config.split_k >= 2


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
@pytest.mark.parametrize(("m", "n", "k"), [(160, 200, 512), (130, 70, 256), (160, 96, 8192)])
def test_chosen_launches_for_verification_batches_match_reference(m: int, n: int, k: int) -> None:
    """The launches choose_config takes for 129..192 rows (a second activation tile; long K: two warpgroups)."""
    _, codes, scales = random_weight(n, k, seed=m + n)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), k, layout="kernel")
    assert choose_config(m, weight).extra_m > 0
    x = torch.randn(m, k)
    assert relative_error(mxfp4_matmul_triton(x.to(DEVICE), weight), reference(x, codes, scales, k)) < 1e-5
    xb = x.to(torch.bfloat16)  # CUDA: the fast path (interpreter: portable)
    yb = mxfp4_matmul_triton(xb.to(DEVICE), weight)
    assert relative_error(yb, reference(xb.float(), codes, scales, k)) < 8e-3


@kernel_test
def test_split_k_and_m_tiles() -> None:
    _, codes, scales = random_weight(67, 1024)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    x = torch.randn(MAX_BLOCK_M + 6, 1024)  # one launch, two M tiles of MAX_BLOCK_M rows
    ref = reference(x, codes, scales, 1024)
    for config in (
        MatmulConfig(tiles=2, split_k=1),
        MatmulConfig(tiles=2, split_k=4),
        MatmulConfig(tiles=1, split_k=3),
        MatmulConfig(tiles=2, split_k=3, block_m=16),  # 9 M tiles; split 3 of 4 steps is empty
        MatmulConfig(tiles=1, split_k=1, block_m=256),  # one M tile, float32 x: fewer stages
        MatmulConfig(tiles=2, split_k=1, block_m=32, extra_m=16),  # 2 tiles of 32 + 16 rows; the last one's 16 empty
        MatmulConfig(tiles=1, split_k=4, block_m=64, extra_m=16),  # 1 tile, 64 + 6 rows; split-K sums both
    ):
        for _ in range(2):  # the arrival counters reset for the next launch
            assert relative_error(mxfp4_matmul_triton(x.to(DEVICE), weight, config), ref) < 1e-5, config


@kernel_test
def test_split_k_up_to_one_step_per_program() -> None:
    """MAX_SPLIT_K splits of 32 k-tiles: every program one k-step of one or two tiles (what the launch sweep tries)."""
    _, codes, scales = random_weight(67, 4096)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    x = torch.randn(3, 4096)
    ref = reference(x, codes, scales, 4096)
    for config in (MatmulConfig(tiles=1, split_k=MAX_SPLIT_K), MatmulConfig(tiles=2, split_k=MAX_SPLIT_K // 2)):
        assert relative_error(mxfp4_matmul_triton(x.to(DEVICE), weight, config), ref) < 1e-5, config


def test_block_m_follows_m() -> None:
    assert [default_block_m(m) for m in (1, 16, 17, 33, 64, 65, 512)] == [16, 16, 32, 64, 64, 64, 64]
    assert MatmulConfig(block_m=8).block_m == 8 and MatmulConfig(block_m=256).block_m == 256
    with pytest.raises(AssertionError):
        MatmulConfig(extra_m=32)  # a second tile needs a fixed first one


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
@pytest.mark.parametrize(("n", "k", "r0", "rows"), [(67, 200, 0, 67), (200, 384, 64, 100), (131, 96, 128, 3)])
def test_dequantized_rows_equal_reference(n: int, k: int, r0: int, rows: int) -> None:
    """The Triton decode of kernel-layout rows (a slab from a row group on, K not a multiple of the k-tile)."""
    _, codes, scales = random_weight(n, k, seed=n)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), k, layout="kernel")
    assert weight.exp_offset == 0
    dense = dequantize_mxfp4(codes, scales, k=k)[r0 : r0 + rows]
    out = torch.full((rows, k), float("nan"), device=DEVICE)
    assert torch.equal(dequantize_prepared_into(weight, r0, out).cpu(), dense)  # float32: the portable decode
    if DEVICE == "cuda":  # bf16: the fast decode, the same values
        out = torch.empty(rows, k, dtype=torch.bfloat16, device=DEVICE)
        assert torch.equal(dequantize_prepared_into(weight, r0, out).cpu(), dense.to(torch.bfloat16))


@kernel_test
def test_dequantized_linear_by_slabs_with_nan_blocks_and_exponent_offset() -> None:
    """Slabs of kernel-layout rows through a bounded scratch, the output scaled by 2^c before the bias."""
    w = torch.randn(200, 256)
    w[3, 40] = float("nan")
    w[5, 64:96] *= 2.0**60  # an exponent offset c > 0
    codes, scales = quantize_mxfp4(w)
    weight = prepare_weight(codes.to(DEVICE), scales.to(DEVICE), layout="kernel")
    assert weight.has_nan and weight.exp_offset > 0
    x, bias = torch.randn(5, 256), torch.randn(200)
    ref = reference(x, codes, scales, 256) + bias.double()
    scratch = DequantScratch()
    for max_weights in (200 * 256, 64 * 256):  # at once; slabs of 64 rows (the last 8)
        y = dequantized_linear(x.to(DEVICE), weight, bias.to(DEVICE), scratch, max_weights).cpu()
        assert torch.equal(y.isnan(), ref.isnan()) and y[:, 3].isnan().all()
        assert relative_error(y[~ref.isnan()], ref[~ref.isnan()]) < 1e-5, max_weights
    assert scratch.nbytes == 200 * 256 * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dense path is CUDA's")
def test_many_rows_multiply_the_decoded_weight() -> None:
    """From DENSE_MIN_ROWS rows on, mxfp4_linear is cuBLAS on the decoded bf16 weight: F.linear's bits."""
    _, codes, scales = random_weight(300, 512)
    weight = prepare_weight(codes.cuda(), scales.cuda(), layout="kernel")
    dense = dequantize_mxfp4(codes, scales, k=512).to(torch.bfloat16).cuda()
    x = torch.randn(DENSE_MIN_ROWS, 512, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(mxfp4_linear(x, weight), F.linear(x, dense))
    assert relative_error(mxfp4_linear(x[:-1], weight), reference(x[:-1].float().cpu(), codes, scales, 512)) < 8e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_a_captured_dense_step_keeps_its_scratch_when_a_larger_weight_grows_it() -> None:
    """A CUDA graph captured on many rows reads the scratch its warm-up grew (the dense path, not the kernel);
    a larger weight later replaces the buffer eagerly, and the graph's replays still read the one it captured."""
    _, codes, scales = random_weight(300, 512)
    weight = prepare_weight(codes.cuda(), scales.cuda(), layout="kernel")
    dense = dequantize_mxfp4(codes, scales, k=512).to(torch.bfloat16).cuda()
    scratch = DequantScratch()
    x = torch.randn(DENSE_MIN_ROWS, 512, dtype=torch.bfloat16, device="cuda")
    mxfp4_linear(x, weight, scratch=scratch)  # the warm-up: grows the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mxfp4_linear(x, weight, scratch=scratch)
    graph.replay()
    assert torch.equal(y, F.linear(x, dense))  # cuBLAS's bits: the dense path was captured
    big = prepare_weight(*(t.cuda() for t in random_weight(600, 512)[1:]), layout="kernel")
    mxfp4_linear(x, big, scratch=scratch)  # grows the buffer: the captured one is kept
    y.zero_()
    graph.replay()
    assert torch.equal(y, F.linear(x, dense))
    assert scratch.nbytes == (300 + 600) * 512 * 2
