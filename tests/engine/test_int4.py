"""gpt-fast's int4 g32 yardstick of `bench --synthetic --weights int4`: the tinygemm linear equals its reference."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from specchat.bench.int4 import Int4Linear, dequantize_groups, quantize_groups
from specchat.cli import main

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]


def test_group_quantization_is_within_half_a_step():
    """gpt-fast's asymmetric rule: codes in 0..15 and every weight within half a scale of (q - 8) s + z."""
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    codes, scales_zeros = quantize_groups(w)
    assert codes.min() >= 0 and codes.max() <= 15 and scales_zeros.shape == (3, 16, 2)
    step = scales_zeros[..., 0].float().transpose(0, 1).repeat_interleave(32, dim=1)  # [N, K]
    assert ((w - dequantize_groups(codes, scales_zeros)).abs() <= step / 2 + 1e-2 * step + 1e-3).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [576, 256])  # 576: the default model's hidden size (fewer inner k-tiles)
def test_int4_linear_equals_the_dequantized_weight(device, k):
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, k, generator=gen), torch.randn(5, k, generator=gen)
    linear = Int4Linear(w.to(device))
    y = linear(x.to(device)).float().cpu()
    ref = x.bfloat16().float() @ dequantize_groups(*quantize_groups(w)).T
    torch.testing.assert_close(y, ref, atol=0.2, rtol=2e-2)  # bf16 activations and output
    assert linear(x[:1].to(device)).shape == (1, 64)


def test_synthetic_bench_runs_the_int4_yardstick():
    args = ["bench", "--synthetic", "tiny", "--device", "cpu", "--weights", "bf16,int4", "--k", "0"]
    run = CliRunner().invoke(main, [*args, "--steps", "2", "--context", "8", "--json"])
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["case"]["weights"] for r in rows] == ["float32", "int4"]
    assert rows[1]["weights_bytes"] < rows[0]["weights_bytes"] / 2  # int4 + scales vs fp32 (the embedding stays)
    bad = CliRunner().invoke(main, ["bench", "--synthetic", "tiny", "--device", "cpu", "--weights", "int8"])
    assert bad.exit_code != 0 and "--weights takes" in bad.output
