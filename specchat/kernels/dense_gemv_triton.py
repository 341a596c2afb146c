"""The dense GEMV's Triton kernel and its launcher, `dense_gemv`: y[M, N] = x[M, K] @ W[N, K]^T, M <= MAX_ROWS.

kernels/dense_gemv.py says why (read it first), what the gated form computes, where the kernel runs and how it is
launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton
from specchat.kernels.dense_gemv import GemvConfig, add_norm_supported, choose_config, supported
from specchat.kernels.fused_triton import rms_normed

PREFETCH_TILES = 2  # with PDL: weight tiles per program prefetched into the L2 before the wait


@triton.jit
def _dense_gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (gated: [2 * N, K], gate rows then up rows)
    b_ptr,  # [N] bias (gated: [2 * N]), or anything when HAS_BIAS is off
    r_ptr,  # [M, N] residual, or anything when neither HAS_RESIDUAL nor ADD_NORM is on
    y_ptr,  # [M, N] (ADD_NORM: the normalised sum)
    s_ptr,  # ADD_NORM: [M, N] the sum residual + y, else anything
    nw_ptr,  # ADD_NORM: [N] the norm's weight, else anything
    counter_ptr,  # ADD_NORM: one int32 arrival counter, zero between launches, else anything
    M,
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_rm,
    stride_ym,
    stride_sm,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACT: tl.constexpr,
    ADD_NORM: tl.constexpr,  # s = r + y (add_rms_norm's add), and y = RMSNorm(s) by the last program to finish
    BLOCK_D: tl.constexpr,  # ADD_NORM: N rounded up to a power of two (a whole row)
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
    out_live = m_live & (offs_n[:, None] < N)
    if not ADD_NORM:
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], y, mask=out_live)
    else:  # fused_triton.add_rms_norm(r, y) without its launch: each program adds its columns, the last the norm
        r = tl.load(r_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_live, other=0.0)
        tl.store(s_ptr + offs_m[None, :] * stride_sm + offs_n[:, None], (r.to(tl.float32) + y.to(tl.float32)).to(dtype),
                 mask=out_live)  # fmt: skip
        tl.debug_barrier()  # every thread's sums are written before the (release) arrival below
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            cols = tl.arange(0, BLOCK_D)
            live = cols < N
            nw = tl.load(nw_ptr + cols, mask=live, other=0.0).to(tl.float32)
            for m in range(M):
                row = tl.load(s_ptr + m * stride_sm + cols, mask=live, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + m * stride_ym + cols, rms_normed(row.to(tl.float32), nw, N, eps, dtype), mask=live)
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch


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
    _launch(x2, weight, bias, r2, y, None, None, None, 0.0, gated, act, fast, config)
    return y.view(*x.shape[:-1], n)


def dense_gemv_add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    counters: torch.Tensor,
    config: GemvConfig | None = None,
    fast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_triton.add_rms_norm(residual, dense_gemv(x, weight, bias), norm_weight, eps) in one launch, the same
    bits: (s, RMSNorm(s)) with s = residual + the rounded projection [M, N]. The last program to finish (one
    arrival counter, `counters[0]`: kernels/device.py's `arrival_counters`) normalises the rows (`add_norm_supported`)."""
    assert supported(x, weight, bias) and add_norm_supported(x, weight, residual, norm_weight), (x.shape, weight.shape)
    x2 = x.reshape(-1, x.shape[-1])
    m, n = x2.shape[0], weight.shape[0]
    r2 = residual.reshape(m, n)
    if fast is None:
        fast = x.is_cuda
    s = torch.empty((m, n), dtype=x.dtype, device=x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(
        x2,
        weight,
        bias,
        r2,
        y,
        s,
        norm_weight,
        counters,
        eps,
        False,
        False,
        fast,
        config or choose_config(n, x2.shape[1], m=m),
    )
    return s.view(residual.shape), y.view(residual.shape)


def _launch(x2, weight, bias, r2, y, s, norm_weight, counters, eps, gated, act, fast, config: GemvConfig) -> None:
    """One launch of the kernel over y's columns (s, norm_weight and counters: ADD_NORM's, else None)."""
    m, k = x2.shape
    n = y.shape[1]
    add_norm = s is not None
    _dense_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x2, weight, weight if bias is None else bias, y if r2 is None else r2, y, y if s is None else s,
        weight if norm_weight is None else norm_weight, y if counters is None else counters, m, n, k, eps,
        x2.stride(0), weight.stride(0), 0 if r2 is None else r2.stride(0), y.stride(0), 0 if s is None else s.stride(0),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GATED=gated, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=r2 is not None and not add_norm, ACT=act, ADD_NORM=add_norm,
        BLOCK_D=triton.next_power_of_2(n) if add_norm else 1, FAST=fast, PREFETCH=PREFETCH_TILES,
        num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False, **pdl.launch_options(x2.device),
    )  # fmt: skip
