"""The fused elementwise kernels against the plain modules of engine/model.py (their references).

Kernel tests run on CUDA, or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file
in a subprocess with it set). The modules that swap them into a model: tests/engine/test_fusion.py.
"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.model import ModelConfig, RMSNorm, Rotary, RotaryEmbedding, SiluAndMul
from specchat.kernels.fused import rms_norm_supported, rope_qk_supported, silu_mul_supported
from specchat.kernels.fused_triton import add_rms_norm, rms_norm, rope_qk, silu_mul
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_equal_within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same math in the same order: fp32 agrees to a few ulps, half types to one rounding step."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def plain_norm(dim: int, dtype: torch.dtype) -> RMSNorm:
    """The reference RMSNorm with a seeded weight around 1, on the test device."""
    plain = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(dim, generator=gen(1)) + 0.5)
    return plain.to(DEVICE, dtype)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_kernel(dtype, rows, dim):
    plain = plain_norm(dim, dtype)
    x = (torch.randn(rows, dim, generator=gen(2)) * 3).to(DEVICE, dtype)
    assert rms_norm_supported(x, plain.weight)
    assert_equal_within_rounding(rms_norm(x, plain.weight, plain.eps), plain(x))


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 96), (3, 576)])
def test_add_rms_norm_kernel_is_the_residual_add_then_the_norm(dtype, rows, dim):
    plain = plain_norm(dim, dtype)
    x = (torch.randn(rows, dim, generator=gen(2)) * 3).to(DEVICE, dtype)
    h = (torch.randn(rows, dim, generator=gen(6)) * 2).to(DEVICE, dtype)
    x_before = x.clone()
    s, y = add_rms_norm(x, h, plain.weight, plain.eps)
    assert torch.equal(s, x + h)  # the add rounds as torch's does: the residual stream keeps its bits
    assert_equal_within_rounding(y, plain(x + h))
    assert torch.equal(x, x_before)  # x untouched: it may be a tapped hidden state


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kernel_writes_the_steps_keys_and_values_into_dense_pages(dtype):
    """With pages, the same launch stores the rotated keys and the values at each token's slot, [KVH, slots, D]
    as PageTensor.write puts them, and leaves every other slot alone; q and k come out as without pages."""
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=4096)  # fmt: skip
    t, slots_total = 5, 24
    qkv = torch.randn(t, (4 + 2 + 2) * 16, generator=gen(7)).to(DEVICE, dtype)
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    q, k, v = q.view(t, 4, 16), k.view(t, 2, 16), v.view(t, 2, 16)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(torch.tensor([3, 4, 5, 40, 41], device=DEVICE))
    slots = torch.tensor([7, 8, 9, 20, 2], device=DEVICE)
    k_pages = torch.randn(2, slots_total, 16, generator=gen(8)).to(DEVICE, dtype)
    v_pages = torch.randn(2, slots_total, 16, generator=gen(9)).to(DEVICE, dtype)
    want_k_pages, want_v_pages = k_pages.clone(), v_pages.clone()
    want_q, want_k = rope_qk(q, k, cos, sin)
    want_k_pages[:, slots] = want_k.transpose(0, 1)
    want_v_pages[:, slots] = v.transpose(0, 1)
    got_q, got_k = rope_qk(q, k, cos, sin, v=v, pages=(k_pages, v_pages, slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(k_pages, want_k_pages) and torch.equal(v_pages, want_v_pages)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kernel_reads_strided_q_and_k(dtype):
    cfg = ModelConfig(arch="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=4096)  # fmt: skip
    t = 7
    qkv = torch.randn(t, (4 + 2 + 2) * 16, generator=gen(3)).to(DEVICE, dtype)  # as the fused projection gives
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(t, 4, 16), k.view(t, 2, 16)
    assert not q.is_contiguous()
    positions = torch.tensor([0, 1, 2, 100, 101, 3000, 4095], device=DEVICE)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE)(positions)
    assert rope_qk_supported(q)
    want_q, want_k = Rotary()(q, k, cos, sin)
    got_q, got_k = rope_qk(q, k, cos, sin)
    assert_equal_within_rounding(got_q, want_q)
    assert_equal_within_rounding(got_k, want_k)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inner", [(1, 48), (4, 1500)])  # 1500: more than one block per row
def test_silu_mul_kernel(dtype, rows, inner):
    x = (torch.randn(rows, 2 * inner, generator=gen(4)) * 4).to(DEVICE, dtype)
    assert silu_mul_supported(x)
    assert_equal_within_rounding(silu_mul(x), SiluAndMul()(x))


def test_kernels_are_not_supported_where_they_cannot_run():
    """float64 everywhere, a head_dim that is not a power of two, a weight in another dtype."""
    x = torch.randn(3, 64, dtype=torch.float64, device=DEVICE)
    assert not silu_mul_supported(x) and not rope_qk_supported(x.view(3, 4, 16))
    assert not rope_qk_supported(torch.randn(3, 4, 24, device=DEVICE))
    assert not rms_norm_supported(x.float(), torch.ones(64, dtype=torch.float16, device=DEVICE))


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "kernel")


@kernel_test
def test_advance_kernel_moves_positions_context_and_slots_as_the_reference():
    """Three requests of q = 5 staged at advance 0, moved by 0, 3 and 4 (one across a page boundary, one on a
    page of its table that is not the next in the pool)."""
    from specchat.kernels.fused_triton import advance_step, advance_step_ref

    n, q, width, page = 3, 5, 6, 16
    starts = torch.tensor([1, 12, 40])
    positions = (starts[:, None] + torch.arange(q)).to(DEVICE)
    tables = torch.randperm(64, generator=gen(5))[: n * width].view(n, width).to(DEVICE, torch.int32)
    ctx = (starts + q).to(DEVICE, torch.int32)
    advance = torch.tensor([0, 3, 4], device=DEVICE)
    got = [positions.clone(), torch.zeros(n * q, dtype=torch.long, device=DEVICE), ctx.clone()]
    want = [positions.clone(), torch.zeros(n * q, dtype=torch.long, device=DEVICE), ctx.clone()]
    advance_step(*got[:2], got[2], tables, advance, page)
    advance_step_ref(*want[:2], want[2], tables, advance, page)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert want[0][1, 0] == 15 and want[0][1, 1] == 16  # request 1 crosses into its table's second page
    assert want[1][q + 1] == tables[1, 1] * page
