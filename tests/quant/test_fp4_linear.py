"""Fp4Linear: packed weights are the only resident copy, and it computes x @ dequant(W)^T + b."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specchat.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear, rotate_blocks


def test_cpu_module_holds_only_packed_weights() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(96, 40, bias=True)
    fp4 = Fp4Linear.from_linear(dense, rule="mse")
    buffers = dict(fp4.named_buffers())
    assert set(buffers) == {"codes", "scales"}
    assert buffers["codes"].dtype == torch.uint8 and buffers["codes"].shape == (40, 48)  # 2 codes a byte
    assert buffers["scales"].dtype == torch.uint8 and buffers["scales"].shape == (40, 3)  # one per 32
    assert [name for name, _ in fp4.named_parameters()] == ["bias"]  # no dense weight anywhere
    assert fp4.nbytes == 40 * 48 + 40 * 3


def test_forward_equals_dense_linear_on_dequantized_weight() -> None:
    torch.manual_seed(1)
    dense = nn.Linear(80, 33, bias=True)  # K not a multiple of 32: padded blocks
    codes, scales = quantize_mxfp4(dense.weight.detach(), rule="roundup")
    fp4 = Fp4Linear.from_packed(codes, scales, 80, dense.bias.detach().clone())
    x = torch.randn(7, 80)
    expected = F.linear(x, dequantize_mxfp4(codes, scales, torch.float32, k=80), dense.bias)
    with torch.inference_mode():  # as the engine runs it (the shared scratch buffer is an inference tensor)
        torch.testing.assert_close(fp4(x), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(fp4.packed()[0], codes) and torch.equal(fp4.packed()[1], scales)


def test_to_linear_round_trips_the_values() -> None:
    torch.manual_seed(2)
    fp4 = Fp4Linear.from_linear(nn.Linear(64, 16, bias=False))
    linear = fp4.to_linear(torch.float32)
    assert torch.equal(linear.weight, fp4.dequantized(torch.float32))
    assert torch.equal(Fp4Linear.from_linear(linear).packed()[0], fp4.packed()[0])  # MXFP4 values re-encode exactly


def test_rotated_module_computes_x_times_its_effective_weight() -> None:
    """RotatedFp4Linear holds W R and computes (x R)(W R)^T: the layer of the effective weight dequant(W R) R."""
    torch.manual_seed(3)
    dense = nn.Linear(64, 24, bias=True)
    fp4 = RotatedFp4Linear.from_linear(dense)
    codes, scales = fp4.packed()
    effective = rotate_blocks(dequantize_mxfp4(codes, scales, torch.float32, k=64))  # [N, K]
    assert torch.equal(fp4.dequantized(torch.float32), effective)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fp4(x), F.linear(x, effective, dense.bias), rtol=1e-5, atol=1e-5)
        relative_error = (fp4(x) - dense(x)).norm() / dense(x).norm()
        assert relative_error < 0.2  # and close to the original layer (4-bit elements)


def test_cpu_kernel_takes_a_steps_rows_and_mxfp4_linear_the_rest() -> None:
    """On the CPU up to cpu_gemv.MAX_ROWS rows go through the C kernel over the codes as stored (the reference's
    values up to float32 sums), each row alone; more rows, and K not whole blocks, through mxfp4_linear."""
    from specchat.kernels import cpu_gemv
    from specchat.kernels.mxfp4_matmul import mxfp4_linear

    if not cpu_gemv.available():
        return
    torch.manual_seed(4)
    for cls in (Fp4Linear, RotatedFp4Linear):
        fp4 = cls.from_linear(nn.Linear(96, 40, bias=True))
        assert fp4.bound() is not None and fp4.bound() is fp4.bound()  # bound once
        x = torch.randn(3, 4, 96)  # 12 rows, batched dims kept
        with torch.inference_mode():
            reference = F.linear(x, fp4.dequantized(torch.float32), fp4.bias)
            got = fp4(x)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
            assert torch.equal(fp4(x[1, 2:3]), got[1, 2:3])  # a row alone: the same bits
            low = fp4(x.bfloat16())  # a bf16 model's rows: widened, multiplied, rounded back
            assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), got, rtol=0.05, atol=0.05)
            many = torch.randn(cpu_gemv.MAX_ROWS + 1, 96)
            plain = many if cls is Fp4Linear else rotate_blocks(many)
            assert torch.equal(fp4(many), mxfp4_linear(plain, fp4.weight_mxfp4, fp4.bias))
    odd = Fp4Linear.from_linear(nn.Linear(80, 8))  # K = 80: padded blocks, mxfp4_linear
    assert odd.bound() is None
