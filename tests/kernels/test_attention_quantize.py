"""KV page element formats: the MXFP8 reference on hand-built blocks, the MXFP4 table decode, and the Triton
quantize-on-append kernel bit for bit against the references (CUDA, or TRITON_INTERPRET=1 through the
subprocess test in test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from specchat.kernels.kv_quant import (
    PageTensor,
    dequantize_mxfp4_rows,
    dequantize_mxfp8,
    quantize_mxfp4_rows,
    quantize_mxfp8,
)
from specchat.kernels.kv_quant_triton import quantize_into_pages
from specchat.kernels.mxfp4 import E8M0_BIAS, E8M0_NAN, RULES, dequantize_mxfp4, quantize_mxfp4
from tests.kernels.interpreter import DEVICE, kernel_test


def test_mxfp8_round_up_scale_never_clips():
    block = torch.zeros(32)
    block[0], block[1], block[2] = 480.0, -1.0, 3.0  # amax 480 > 448: the scale goes up to 2^1
    codes, scales = quantize_mxfp8(block)
    assert scales.item() == E8M0_BIAS + 1
    values = dequantize_mxfp8(codes, scales)
    assert values[0] == 480.0 and values[1] == -1.0 and values[2] == 3.0
    block[0] = 448.0  # fits the E4M3 range exactly: scale 2^0
    assert quantize_mxfp8(block)[1].item() == E8M0_BIAS


def test_mxfp8_zero_nan_and_rounding():
    zeros = torch.zeros(64)
    zeros[33] = -0.0
    codes, scales = quantize_mxfp8(zeros)
    assert torch.all(dequantize_mxfp8(codes, scales) == 0) and codes[33] == 0x80
    nan_block = torch.ones(32)
    nan_block[7] = float("nan")
    codes, scales = quantize_mxfp8(nan_block)
    assert scales.item() == E8M0_NAN and torch.all(codes == 0)
    # 1 + 1/16 is halfway between E4M3's 1 and 1.125: ties to even (1); 1 + 3/16 rounds up to 1.25
    block = torch.tensor([4.0, 1.0625, 1.1875] + [0.0] * 29)
    values = dequantize_mxfp8(*quantize_mxfp8(block))
    assert values[:3].tolist() == [4.0, 1.0, 1.25]


def test_mxfp8_error_bound():
    x = torch.randn(50, 128) * torch.exp(torch.randn(50, 1) * 2)
    values = dequantize_mxfp8(*quantize_mxfp8(x))
    amax = x.reshape(50, 4, 32).abs().amax(-1, keepdim=True)
    # 3 mantissa bits: error <= 2^-4 of the element, or of the subnormal step below amax / 2^15
    error = (values - x).reshape(50, 4, 32).abs()
    assert torch.all(error <= x.reshape(50, 4, 32).abs() / 16 + amax * 2.0**-15)


def awkward_rows(tokens: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows over many magnitudes, with a zero, a NaN, an inf, a -0.0, a tiny and a huge block and grid ties."""
    x = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    x = x * torch.exp(torch.randn(tokens, kv_heads, 1, generator=gen) * 3)
    x[0, 0, :32] = 0.0
    x[1, 1, 5] = float("nan")
    x[1, 0, 33] = float("-inf")
    x[2, 0, 40] = -0.0
    x[3, 2] *= 1e-20
    x[5, 2] *= 1e30
    x[4, 1, :32] = torch.tensor([4.5, -5.0, 2.5, 0.75] * 8)  # exact ties on the grid, and between candidates
    return x


@pytest.mark.parametrize("rule", RULES)
def test_fast_mxfp4_quantizer_equals_reference(rule):
    x = awkward_rows(6, 3, 64, torch.Generator().manual_seed(1))
    x[2, 1] *= 1e-20  # float32-subnormal blocks too
    codes, scales = quantize_mxfp4_rows(x, rule)
    expected_codes, expected_scales = quantize_mxfp4(x, rule)
    assert torch.equal(codes, expected_codes) and torch.equal(scales, expected_scales)


def test_mxfp4_table_decode_equals_reference():
    codes = torch.arange(256, dtype=torch.uint8).reshape(4, 2, 32)  # every byte
    scales = torch.tensor([[[120, 127]], [[0, 130]], [[254, 1]], [[E8M0_NAN, 127]]], dtype=torch.uint8).expand(4, 2, 2)
    expected = dequantize_mxfp4(codes, scales.contiguous())
    torch.testing.assert_close(dequantize_mxfp4_rows(codes, scales, torch.float32), expected, equal_nan=True)


@kernel_test
@pytest.mark.parametrize(
    ("fmt", "rule", "head_dim"),
    [
        ("mxfp4", "ocp", 64),
        ("mxfp4", "roundup", 128),
        ("mxfp4", "mse", 64),
        ("mxfp4", "mse", 128),
        ("mxfp8", "mse", 64),
    ],
)
def test_triton_quantize_equals_reference(fmt, rule, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, kv_heads, num_slots = 6, 3, 24
    x = awkward_rows(tokens, kv_heads, head_dim, gen)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    reference = PageTensor.empty(fmt, kv_heads, num_slots, head_dim, torch.float32, "cpu", rule)
    reference.write(slots, x)
    pages = PageTensor.empty(fmt, kv_heads, num_slots, head_dim, torch.float32, DEVICE, rule)
    quantize_into_pages(x.to(DEVICE), slots.to(DEVICE), pages)
    assert torch.equal(pages.data[:, slots.to(DEVICE)].cpu(), reference.data[:, slots])
    assert torch.equal(pages.scales[:, slots.to(DEVICE)].cpu(), reference.scales[:, slots])
