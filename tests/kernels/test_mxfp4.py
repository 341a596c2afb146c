"""The MXFP4 reference (OCP MX v1.0): hand-built blocks, special inputs, padding, round-trip error bounds."""

from __future__ import annotations

import math

import pytest
import torch

from specchat.kernels.mxfp4 import (
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    E8M0_BIAS,
    E8M0_NAN,
    RULES,
    dequantize_mxfp4,
    mxfp4_nbytes,
    mxfp4_storage_shapes,
    pack_nibbles,
    quantize_mxfp4,
    unpack_nibbles,
)

SIGNED_GRID = torch.tensor([*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES)])  # value of code 0..15


def block_of(values: list[float], scale_exp: int) -> torch.Tensor:
    """One 32-element block: the values (times 2^scale_exp), then a 6 * 2^e element so amax fixes e, then 0."""
    block = torch.zeros(BLOCK_SIZE)
    block[: len(values)] = torch.tensor(values)
    block[-1] = 6.0
    return (block * 2.0**scale_exp)[None]  # [1, 32]


def codes_of(x: torch.Tensor, rule: str = "ocp") -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = quantize_mxfp4(x, rule)
    return unpack_nibbles(codes), scales


@pytest.mark.parametrize("scale_exp", [-127, -10, 0, 3, 125])
def test_every_code_survives_at_its_grid_value(scale_exp: int) -> None:
    x = block_of(SIGNED_GRID.tolist(), scale_exp)
    codes, scales = codes_of(x)
    assert scales.item() == scale_exp + E8M0_BIAS
    assert codes[0, :16].tolist() == list(range(16))  # -0.0 keeps its sign bit: code 8
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(x)), x)


def test_ties_round_to_the_even_code() -> None:
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = block_of([*midpoints, *(-m for m in midpoints)], 0)
    codes, _ = codes_of(x)
    expected = [0, 2, 2, 4, 4, 6, 6]  # 0 | 1.0 | 1.0 | 2.0 | 2.0 | 4.0 | 4.0: even mantissa
    assert codes[0, :7].tolist() == expected
    assert codes[0, 7:14].tolist() == [c | 8 for c in expected]


def test_off_tie_values_round_to_nearest() -> None:
    x = block_of([0.26, 0.74, 1.26, 2.49, 2.51, 4.9, 5.1], 0)
    assert codes_of(x)[0][0, :7].tolist() == [1, 1, 3, 4, 5, 6, 7]


def test_ocp_saturates_and_roundup_never_clips() -> None:
    x = block_of([7.9, -7.0, 6.5], 0)  # amax 7.9: floor(log2) - 2 = 0, so 7.9 clips to 6
    codes, scales = codes_of(x, "ocp")
    assert scales.item() == E8M0_BIAS and codes[0, :3].tolist() == [7, 15, 7]
    codes, scales = codes_of(x, "roundup")
    assert scales.item() == E8M0_BIAS + 1  # 7.9 / 2 = 3.95 <= 6
    assert dequantize_mxfp4(*quantize_mxfp4(x, "roundup"))[0, :3].tolist() == [8.0, -8.0, 6.0]


def test_roundup_keeps_ocp_exponent_when_nothing_clips() -> None:
    x = block_of([5.9], 0)[:, :-1]  # amax 5.9 (no 6 marker): ocp exponent 0 already fits
    assert quantize_mxfp4(x, "roundup")[1].item() == quantize_mxfp4(x, "ocp")[1].item() == E8M0_BIAS


def test_all_zero_block() -> None:
    x = torch.zeros(2, 64)
    x[1, 3] = -0.0
    codes, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[0, 0], [0, 0]]
    assert unpack_nibbles(codes)[1, 3].item() == 8 and unpack_nibbles(codes).sum().item() == 8
    assert torch.equal(dequantize_mxfp4(codes, scales), x) and dequantize_mxfp4(codes, scales)[1, 3].signbit()


def test_tiny_blocks_clamp_to_the_smallest_scale() -> None:
    x = torch.zeros(3, 32)
    x[0, 0] = 1e-42  # float32 subnormal amax: scale 2^-127, rounds to zero
    x[1, :2] = torch.tensor([1.5, 0.5]) * 2.0**-126  # exponent -128 clamps to -127: exact (3 and 1 on the grid)
    x[2, :2] = torch.tensor([-(2.0**-128), 2.0**-129])  # 0.5 and 0.25 (a tie, down to 0) on the 2^-127 grid
    codes, scales = quantize_mxfp4(x)
    assert scales.flatten().tolist() == [0, 0, 0]
    deq = dequantize_mxfp4(codes, scales)
    assert deq[0].abs().sum() == 0 and torch.equal(deq[1], x[1])
    assert deq[2, :2].tolist() == [-(2.0**-128), 0.0]


def test_huge_blocks() -> None:
    x = torch.full((1, 32), 3.0e38)
    for rule in ("ocp", "mse"):  # both stay within float32 when dequantized
        codes, scales = quantize_mxfp4(x, rule)
        deq = dequantize_mxfp4(codes, scales)
        assert scales.item() == E8M0_BIAS + 125 and torch.isfinite(deq).all(), rule
        assert (deq - x).abs().max() / 3.0e38 < 0.2
    codes, scales = quantize_mxfp4(x, "roundup")  # 3e38 / 2^126 rounds up to 4: 2^128, beyond float32
    assert scales.item() == E8M0_BIAS + 126 and dequantize_mxfp4(codes, scales).isinf().all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_make_their_block_nan(bad: float) -> None:
    x = torch.randn(2, 96)
    x[1, 40] = bad
    for rule in RULES:
        codes, scales = quantize_mxfp4(x, rule)
        assert scales[1].tolist()[1] == E8M0_NAN and unpack_nibbles(codes)[1, 32:64].sum() == 0
        deq = dequantize_mxfp4(codes, scales)
        assert deq[1, 32:64].isnan().all() and not deq[1, :32].isnan().any() and not deq[0].isnan().any()


def test_k_not_a_multiple_of_32_is_padded_with_zeros() -> None:
    x = torch.randn(3, 45)
    codes, scales = quantize_mxfp4(x)
    assert codes.shape == (3, 32) and scales.shape == (3, 2)
    assert (unpack_nibbles(codes)[:, 45:] == 0).all()
    assert dequantize_mxfp4(codes, scales, k=45).shape == (3, 45)
    assert torch.equal(dequantize_mxfp4(codes, scales, k=45), dequantize_mxfp4(codes, scales)[:, :45])
    assert torch.equal(quantize_mxfp4(x)[0], quantize_mxfp4(torch.nn.functional.pad(x, (0, 19)))[0])


def test_leading_dimensions_and_dtypes() -> None:
    x = torch.randn(2, 3, 64)
    codes, scales = quantize_mxfp4(x.to(torch.bfloat16))
    assert codes.shape == (2, 3, 32) and scales.shape == (2, 3, 2)
    as_bf16 = dequantize_mxfp4(codes, scales, dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16.float(), dequantize_mxfp4(codes, scales))


def test_round_trip_error_bounds() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 1024) * torch.logspace(-3, 3, 64)[:, None]
    blocks = x.reshape(64, -1, BLOCK_SIZE)
    errors = {}
    for rule in RULES:
        codes, scales = quantize_mxfp4(x, rule)
        deq = dequantize_mxfp4(codes, scales).reshape(blocks.shape)
        scale = 2.0 ** (scales.float() - E8M0_BIAS)[..., None]
        unclipped = blocks.abs() <= 6 * scale
        # half the widest grid gap (4 -> 6) is one scale unit; clipped elements lose |x| - 6 * scale
        assert ((deq - blocks).abs() <= torch.where(unclipped, scale, blocks.abs() - 6 * scale)).all(), rule
        assert unclipped.all() or rule != "roundup"
        errors[rule] = ((deq - blocks) ** 2).sum(-1)  # per block
        relative = ((deq - blocks).norm() / blocks.norm()).item()
        assert relative < 0.12, (rule, relative)
    # mse chooses among ocp - 1, ocp, ocp + 1, which include both other rules' exponents
    for rule in ("ocp", "roundup"):
        assert (errors["mse"] <= errors[rule] * (1 + 1e-6)).all(), rule
    assert errors["mse"].sum() < errors["ocp"].sum()


def test_unknown_rule() -> None:
    with pytest.raises(ValueError, match="rounding rule"):
        quantize_mxfp4(torch.randn(32), "stochastic")


def test_packing_and_sizes() -> None:
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 32) and torch.equal(unpack_nibbles(packed), codes)
    assert (packed & 0xF).tolist() == codes[:, 0::2].tolist()  # low nibble = even element
    assert mxfp4_storage_shapes((4096, 14336)) == ((4096, 7168), (4096, 448))
    assert mxfp4_nbytes((4096, 14336)) == 4096 * (7168 + 448)
    assert mxfp4_nbytes((3, 45)) == 3 * (32 + 2)  # padded to 64
