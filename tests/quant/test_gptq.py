"""GPTQ on the MXFP4 grid: exact cases and the error it compensates."""

from __future__ import annotations

import torch

from specchat.kernels.mxfp4 import BLOCK_SIZE, dequantize_mxfp4, quantize_mxfp4
from specchat.quant.gptq import GptqSettings, HessianAccumulator, _column_order, gptq_quantize, rotate_blocks


def test_identity_hessian_gives_round_to_nearest() -> None:
    """With uncorrelated inputs there is no error to move: GPTQ is RTN with the same scale rule."""
    torch.manual_seed(0)
    w = torch.randn(24, 96)
    for rule in ("ocp", "mse"):
        codes, scales = gptq_quantize(w, torch.eye(96), GptqSettings(rule=rule))
        rtn_codes, rtn_scales = quantize_mxfp4(w, rule=rule)
        assert torch.equal(scales, rtn_scales) and torch.equal(codes, rtn_codes)


def test_correlated_inputs_halve_the_output_error() -> None:
    torch.manual_seed(1)
    k = 128
    x = torch.randn(1024, k) @ (torch.eye(k) + 0.2 * torch.randn(k, k))  # [T, K], correlated features
    w = torch.randn(64, k) * 0.05
    acc = HessianAccumulator(k)
    acc.add(x)

    def output_error(codes, scales) -> float:
        return float(((x @ (w - dequantize_mxfp4(codes, scales, k=k)).T) ** 2).mean())

    rtn = output_error(*quantize_mxfp4(w, rule="mse"))
    for act_order in (False, True):
        gptq = output_error(*gptq_quantize(w, acc.result(), GptqSettings(act_order=act_order)))
        assert gptq < 0.6 * rtn


def test_act_order_keeps_blocks_contiguous() -> None:
    torch.manual_seed(2)
    h = torch.diag(torch.rand(128))
    order = _column_order(h, act_order=True)
    assert sorted(order.tolist()) == list(range(128))
    blocks = order.reshape(-1, BLOCK_SIZE) // BLOCK_SIZE  # each run of 32 visits one original block
    assert all(len(set(b.tolist())) == 1 for b in blocks)
    block_weight = h.diagonal().reshape(-1, BLOCK_SIZE).sum(1)[blocks[:, 0]]
    assert torch.all(block_weight[:-1] >= block_weight[1:])


def test_block_rotation_is_orthogonal_and_its_own_inverse() -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(rotate_blocks(rotate_blocks(x)), x)
    torch.testing.assert_close(rotate_blocks(x).norm(dim=1), x.norm(dim=1))
