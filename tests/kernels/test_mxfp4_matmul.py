"""mxfp4_linear on the CPU: F.linear on the dequantized weight, through one scratch buffer the layers share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specchat.kernels.mxfp4 import dequantize_mxfp4
from specchat.kernels.mxfp4_dequant import DequantScratch
from specchat.kernels.mxfp4_matmul import mxfp4_linear, prepare_weight
from tests.kernels.mxfp4_weights import random_weight


def test_cpu_linear_is_f_linear_on_dequantized_weights() -> None:
    _, codes, scales = random_weight(67, 200)
    weight = prepare_weight(codes, scales, 200)  # CPU: the plain layout
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


def test_scratch_made_under_inference_mode_serves_later_calls_outside_it() -> None:
    scratch = DequantScratch()
    weight = prepare_weight(*random_weight(32, 64)[1:])
    x = torch.randn(2, 64)
    with torch.inference_mode():
        want = mxfp4_linear(x, weight, scratch=scratch)
    with torch.no_grad():
        assert torch.equal(mxfp4_linear(x, weight, scratch=scratch), want)
    assert torch.equal(mxfp4_linear(x, weight, scratch=scratch), want)


def test_a_weight_over_the_scratch_limit_goes_by_rows(monkeypatch) -> None:
    """An output head is larger than any block linear: it runs in slices of rows through a bounded scratch."""
    import specchat.kernels.mxfp4_matmul as matmul

    monkeypatch.setattr(matmul, "SCRATCH_MAX_WEIGHTS", 40 * 64)
    scratch = DequantScratch()
    _, codes, scales = random_weight(130, 64)
    weight = prepare_weight(codes, scales, 64)
    x, bias = torch.randn(3, 64), torch.randn(130)
    expected = F.linear(x, dequantize_mxfp4(codes, scales, k=64), bias)
    torch.testing.assert_close(mxfp4_linear(x, weight, bias, scratch=scratch), expected, rtol=1e-6, atol=1e-6)
    assert scratch.nbytes == 40 * 64 * 4  # one slice of 40 rows, not the whole weight
