"""The MXFP4 weight layouts: the kernel layout round-trips bit for bit and records NaN blocks and large scales;
rows gathered from either layout are the interchange rows."""

from __future__ import annotations

import pytest
import torch

from specchat.kernels.mxfp4 import quantize_mxfp4
from specchat.kernels.mxfp4_layout import gather_rows, prepare_weight, unprepare_weight
from tests.kernels.mxfp4_weights import random_weight


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


def test_plain_layout_is_the_interchange_form() -> None:
    _, codes, scales = random_weight(67, 200)
    weight = prepare_weight(codes, scales, 200)  # CPU: the plain layout
    assert not weight.prepared and weight.nbytes == codes.numel() + scales.numel()
    back_codes, back_scales = unprepare_weight(weight)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


@pytest.mark.parametrize("layout", ["plain", "kernel"])
def test_gathered_rows_are_the_interchange_rows(layout: str) -> None:
    w = torch.randn(200, 200)
    w[3, 40] = float("nan")
    w[150, :32] *= 2.0**40  # a large scale: the kernel layout stores it with an exponent offset
    codes, scales = quantize_mxfp4(w, rule="mse")
    weight = prepare_weight(codes, scales, 200, layout=layout)
    rows = torch.tensor([150, 0, 3, 199, 3, 64, 127, 128])  # repeats, both sides of a row group, the padded tail
    got_codes, got_scales = gather_rows(weight, rows)
    assert torch.equal(got_codes, codes[rows]) and torch.equal(got_scales, scales[rows])
