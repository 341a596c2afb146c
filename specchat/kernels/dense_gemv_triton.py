"""The dense GEMV's Triton kernel and its launcher, `dense_gemv`: y[M, N] = x[M, K] @ W[N, K]^T, M <= MAX_ROWS.

kernels/dense_gemv.py says why (read it first), what the gated form computes, where the kernel runs and how it is
launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton
from specchat.kernels.dense_gemv import GemvConfig, choose_config, supported

PREFETCH_TILES = 2  # with PDL: weight tiles per program prefetched into the L2 before the wait


@triton.jit
def _dense_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (gated: [2 * N, K], gate rows then up rows)
    b_ptr,  # [N] bias (gated: [2 * N]), or anything when HAS_BIAS is off
    r_ptr,  # [M, N] residual, or anything when HAS_RESIDUAL is off
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACT: tl.constexpr,
    FAST: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1)  # clamped rather than masked: the loads stay unmasked along N
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if PDL:  # the weights are constant: start their first tiles towards the L2 while the kernel before runs
        for i in tl.static_range(PREFETCH):
            if i * BLOCK_K < K:
                pdl_triton.prefetch_l2(w_ptr + rows * stride_wn + i * BLOCK_K)
                if GATED:
                    pdl_triton.prefetch_l2(w_ptr + (rows + N) * stride_wn + i * BLOCK_K)
    pdl_triton.wait(PDL)  # x and y are other kernels' too: nothing of them before this
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BK, 16]: x^T
    m_live = offs_m[None, :] < M
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_live = (k0 + offs_k) < K
        xt = tl.load(x_ptrs + k0, mask=m_live & k_live[:, None], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_live[None, :], other=0.0)
        if not FAST:
            xt, w = xt.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision="ieee")
        if GATED:
            up = tl.load(w_ptrs + N * stride_wn + k0, mask=k_live[None, :], other=0.0)
            if not FAST:
                up = up.to(tl.float32)
            acc_up = tl.dot(up, xt, acc_up, input_precision="ieee")
    pdl_triton.launch_dependents(PDL)
    dtype = y_ptr.dtype.element_ty
    if HAS_BIAS:  # added to the float32 sums, rounded once (as cuBLAS's epilogue does)
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
        if GATED:
            acc_up += tl.load(b_ptr + N + rows).to(tl.float32)[:, None]
    if HAS_RESIDUAL:  # (as addmm's epilogue: added to the float32 sums, rounded once)
        r_ptrs = r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None]
        acc += tl.load(r_ptrs, mask=m_live & (offs_n[:, None] < N), other=0.0).to(tl.float32)
    y = acc.to(dtype)
    if ACT or GATED:  # silu of the rounded output, rounded again: F.silu after F.linear, or silu_mul's gate
        yf = y.to(tl.float32)
        y = (yf / (1.0 + tl.exp(-yf))).to(dtype)
    if GATED:  # silu(gate) * up as fused_triton.silu_mul rounds it, from the values an ungated launch would store
        y = (y.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, y, mask=m_live & (offs_n[:, None] < N))


def dense_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    config: GemvConfig | None = None,
    fast: bool | None = None,
    act: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x [..., K], weight [N, K], bias) -> [..., N] in x's dtype; gated: weight [2I, K] (and bias [2I])
    -> silu(gate) * up [..., I]. Ungated, `act` takes F.silu of the output and `residual` ([..., N], x's dtype)
    is added to the sums before they are rounded, as torch.addmm(residual, x, weight.t()) adds it.

    fast: the tensor-core path (default on CUDA); otherwise float32 products (the interpreter's).
    """
    assert supported(x, weight, bias), (x.shape, x.dtype, x.stride(), weight.shape, weight.dtype)
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == k and (not gated or weight.shape[0] % 2 == 0), (x.shape, weight.shape)
    assert not (gated and (act or residual is not None)), "gated: silu(gate) * up is the epilogue"
    r2 = None if residual is None else residual.reshape(m, n)
    assert r2 is None or (r2.dtype == x.dtype and r2.stride(-1) == 1), (residual.shape, residual.dtype)
    if fast is None:
        fast = x.is_cuda
    config = config or choose_config(n, k, gated, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _dense_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x2, weight, weight if bias is None else bias, y if r2 is None else r2, y, m, n, k, x2.stride(0),
        weight.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GATED=gated, HAS_BIAS=bias is not None, HAS_RESIDUAL=r2 is not None, ACT=act, FAST=fast,
        PREFETCH=PREFETCH_TILES, num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False,
        **pdl.launch_options(x.device),
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
