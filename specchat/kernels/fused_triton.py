"""One-pass Triton kernels for the small steps of a decoder layer: RMSNorm, rotary embedding, SiLU-and-mul.

At batch 1 an 8B model's step is four matmuls per layer and, in plain PyTorch, ~40 small elementwise kernels
around them (RMSNorm alone is six: cast, square, mean, rsqrt, two multiplies). Inside a CUDA graph launches
are free, but each kernel still costs a few microseconds of GPU time: on the H200 they took ~2.6 ms of a
6.6 ms bf16 step (docs/benchmarks.md). These kernels do each job in one pass over its data.

Each kernel sits beside its wrapper (which asserts its inputs); its `*_supported` check (where it runs: CUDA, or
the CPU under TRITON_INTERPRET=1, and the dtypes and shapes it takes) is in kernels/fused.py, which the CPU path
imports without importing this module or Triton. The engine applies them from outside (docs/style.md #3):
engine/fusion.py swaps the model's plain modules for ones that call these. The plain modules in engine/model.py
are the references; tests/kernels/test_fused.py holds each kernel to its reference (same fp32 arithmetic, results
rounded to the activation dtype once, as PyTorch does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specchat.kernels import pdl, pdl_triton

SILU_BLOCK = 1024


# --- RMSNorm ------------------------------------------------------------------------------------------------


@triton.jit
def rms_normed(x, w, n, eps, dtype):
    """One row's RMSNorm as the plain module rounds it: x and w [BLOCK] in fp32 (zeros past n) -> w * (x
    normalised in fp32, cast to dtype), cast to dtype (the row kernels here and in kernels/draft_heads_triton.py)."""
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    return (w * (x * r).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, stride_x, stride_y, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, rms_normed(x, w, n, eps, y_ptr.dtype.element_ty), mask=live)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * normalise(x) in x's dtype (weight in x's dtype too)."""
    assert weight.dtype == x.dtype and x.shape[-1] == weight.shape[0], (x.dtype, weight.dtype, x.shape)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        weight,
        y,
        n,
        x2.stride(0),
        y.stride(0),
        eps,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        enable_fp_fusion=False,
        **pdl.launch_options(x.device),
    )
    return y.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, h_ptr, w_ptr, s_ptr, y_ptr, n, stride_x, stride_h, stride_s, stride_y, eps, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """s = x + h rounded to the dtype (as torch's add), then the RMSNorm of s: one pass over the row."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + cols, mask=live, other=0.0).to(tl.float32)
    s = (x + h).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_s + cols, s, mask=live)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, rms_normed(s.to(tl.float32), w, n, eps, y_ptr.dtype.element_ty), mask=live)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, weight * normalise(x + h)) for x, h [T, D] of one dtype: a residual add and the norm after it in one
    kernel (two tensors, both new: x may be a tapped state that must not change)."""
    assert x.shape == h.shape and x.dtype == h.dtype == weight.dtype and x.dim() == 2, (x.shape, h.shape)
    assert x.stride(-1) == 1 and h.stride(-1) == 1, (x.stride(), h.stride())
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[1]
    block = triton.next_power_of_2(n)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, h, weight, s, y, n, x.stride(0), h.stride(0), s.stride(0), y.stride(0), eps,
            BLOCK=block, num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,
            **pdl.launch_options(x.device),
        )  # fmt: skip
    return s, y


# --- rotary embedding of q and k ------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_pages_ptr, v_pages_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_page_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (token, head): heads 0 .. H-1 are q's, the next KVH k's, with WRITE_KV the last KVH v's.
    x * cos + rotate_half(x) * sin in fp32; with WRITE_KV each rotated key and each value also goes to its slot
    of the dense KV pages ([KVH, slots, D]), as the pool's write would put it (the value programs only copy)."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    slot = tl.load(slots_ptr + t) if WRITE_KV else 0
    if h >= NUM_Q_HEADS + NUM_KV_HEADS:  # a value row (launched only with WRITE_KV): copied as it is
        kvh = h - NUM_Q_HEADS - NUM_KV_HEADS
        src = v_ptr + t * stride_vt + kvh * stride_vh
        dst = v_pages_ptr + kvh * stride_page_head + slot * 2 * HALF
        tl.store(dst + d, tl.load(src + d).to(v_pages_ptr.dtype.element_ty))
        tl.store(dst + HALF + d, tl.load(src + HALF + d).to(v_pages_ptr.dtype.element_ty))
    else:
        c1 = tl.load(cos_ptr + t * stride_ct + d)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d)
        s1 = tl.load(sin_ptr + t * stride_ct + d)
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + d)
        if h < NUM_Q_HEADS:
            src = q_ptr + t * stride_qt + h * stride_qh
            dst = q_out_ptr + (t * NUM_Q_HEADS + h) * 2 * HALF
        else:
            src = k_ptr + t * stride_kt + (h - NUM_Q_HEADS) * stride_kh
            dst = k_out_ptr + (t * NUM_KV_HEADS + h - NUM_Q_HEADS) * 2 * HALF
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + HALF + d).to(tl.float32)
        # the reference rounds each product and the sum in fp32 (no fused multiply-add): keep its order
        a1 = x1 * c1
        b1 = (-x2) * s1
        a2 = x2 * c2
        b2 = x1 * s2
        y1 = (a1 + b1).to(q_out_ptr.dtype.element_ty)
        y2 = (a2 + b2).to(q_out_ptr.dtype.element_ty)
        tl.store(dst + d, y1)
        tl.store(dst + HALF + d, y2)
        if WRITE_KV:  # noqa: SIM102 (a constexpr branch: Triton compiles it out)
            if h >= NUM_Q_HEADS:
                page = k_pages_ptr + (h - NUM_Q_HEADS) * stride_page_head + slot * 2 * HALF
                tl.store(page + d, y1.to(k_pages_ptr.dtype.element_ty))
                tl.store(page + HALF + d, y2.to(k_pages_ptr.dtype.element_ty))


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] (any row and head strides), cos/sin [T, D] fp32 -> contiguous rotated q, k.

    With `pages` = (key pages, value pages, slots [T]), the dense pages [KVH, slots, D] of one layer, the same
    launch also stores the rotated keys and v [T, KVH, D] at each token's slot (the KV write of the step).
    """
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and q.dtype == k.dtype, (q.stride(), k.stride())
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    q_out = torch.empty((t, num_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if pages is None:
        v_arg, k_pages, v_pages, slots, programs, page_head = k, k_out, k_out, cos, num_heads + num_kv_heads, 0
    else:
        k_pages, v_pages, slots = pages
        assert v is not None and v.shape == k.shape and v.stride(-1) == 1 and v.dtype == k.dtype, v
        assert k_pages.shape == v_pages.shape and k_pages.is_contiguous() and v_pages.is_contiguous()
        assert k_pages.shape[0] == num_kv_heads and k_pages.shape[2] == head_dim and slots.shape == (t,)
        v_arg, programs, page_head = v, num_heads + 2 * num_kv_heads, k_pages.stride(0)
    if t:
        _rope_kernel[(t, programs)](
            q, k, v_arg, cos, sin, q_out, k_out, k_pages, v_pages, slots,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1), cos.stride(0),
            page_head,
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, WRITE_KV=pages is not None,
            num_warps=1, enable_fp_fusion=False, **pdl.launch_options(q.device),
        )  # fmt: skip
    return q_out, k_out


# --- SiLU-and-mul ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, n, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = silu(x[:, :n]) * x[:, n:], silu rounded to the output dtype first (as F.silu then * does)."""
    pdl_triton.launch_dependents(PDL)
    pdl_triton.wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=live, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (silu * up).to(y_ptr.dtype.element_ty), mask=live)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:]."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[1] // 2
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(n, SILU_BLOCK))
        _silu_mul_kernel[grid](
            x2, y, n, x2.stride(0), y.stride(0), BLOCK=SILU_BLOCK, num_warps=4, enable_fp_fusion=False,
            **pdl.launch_options(x.device),
        )  # fmt: skip
    return y.view(*x.shape[:-1], n)


# --- a step's metadata moved on the device -------------------------------------------------------------------


@triton.jit(do_not_specialize=["q", "width"])  # one compile for every graph's widths
def _advance_kernel(pos_ptr, slot_ptr, ctx_ptr, table_ptr, adv_ptr, q, width, page, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    a = tl.load(adv_ptr + b)
    j = tl.arange(0, BLOCK)
    m = j < q
    pos = tl.load(pos_ptr + b * q + j, mask=m) + a
    tl.store(pos_ptr + b * q + j, pos, mask=m)
    blocks = tl.load(table_ptr + b * width + pos // page, mask=m)
    tl.store(slot_ptr + b * q + j, blocks.to(tl.int64) * page + pos % page, mask=m)
    tl.store(ctx_ptr + b, tl.load(ctx_ptr + b) + a.to(tl.int32))


def advance_step(
    positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor, advance: torch.Tensor,
    page_size: int,
) -> None:  # fmt: skip
    """Move a staged step's requests by advance [n] (int64) in place, in one launch: positions [n, q] (int64) +=
    advance, context lengths [n] (int32) += advance, and the slots [n * q] (int64) made again from the block tables
    [n, W] (int32): table[position // page_size] * page_size + position % page_size. `advance_step_ref` is the
    reference; a CUDA-graph step launched before the host knows how far its requests moved uses it (cuda_graph.py)."""
    n, q = positions.shape
    assert positions.is_contiguous() and slots.is_contiguous() and tables.stride(1) == 1
    assert advance.shape == (n,) and advance.is_contiguous()
    assert positions.dtype == slots.dtype == advance.dtype == torch.int64 and ctx_lens.dtype == tables.dtype
    _advance_kernel[(n,)](
        positions, slots, ctx_lens, tables, advance, q, tables.stride(0), page_size, BLOCK=triton.next_power_of_2(q)
    )


def advance_step_ref(
    positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor, advance: torch.Tensor,
    page_size: int,
) -> None:  # fmt: skip
    positions += advance[:, None]
    ctx_lens += advance.to(ctx_lens.dtype)
    pages = tables.gather(1, positions // page_size).long()
    slots.copy_((pages * page_size + positions % page_size).view(-1))
