"""The draft heads' greedy chain in four or five launches a head (issue 13).

A sequential head (engine/drafters/heads.py, `HeadBlock`) turns the state s and the previous token x into the
next state and its draft:

    u = [norm_s(s); norm_e(E[x])]     s' = s + W_down silu(W_up u)     x' = vocab[argmax(rows @ norm(s'))]

In plain PyTorch that is ~13 kernels a head (the embedding gather, two norms, a cat, two matmuls, SiLU, the
residual add, the final norm, the draft rows' matmul, a cast to fp32, the argmax and the vocabulary lookup). On
the H200 at one session, inside the chain's CUDA graph, each still costs 1.5-6 us of device time: ~30 us a head,
~120 us of a 1.1 ms drafting step at k = 4 (docs/benchmarks.md, nineteenth session). Here a head is five (four):

- `_head_input_kernel` (one program per request): picks the previous head's draft from its partial argmaxes (or
  takes the newest token, for the first head), writes it to the chain's output, gathers its embedding and writes
  u with both norms applied;
- W_up (cuBLAS), SiLU, and W_down with the residual add as one `addmm` (cuBLAS's epilogue); on CUDA at up to
  16 rows of half-precision weights, two launches of kernels/dense_gemv_triton.py instead, W_up with the SiLU
  and W_down with the residual add as their epilogues, which join the step's chain of programmatic dependent
  launches (H100, real default model, k = 4: heads 1.4% and ngram+heads 1.6% faster at one session, 0.3-0.6% at
  eight; docs/benchmarks.md, fifty-third session);
- `_draft_argmax_kernel` (one program per 64 draft rows and 16 requests): the final norm of s', the draft rows'
  logits for the program's rows, rounded to the activation dtype as the plain matmul's output is, and their
  argmax (first index of the largest), kept as one partial per program for the next head's input kernel to pick
  from.

The plain chain (`HeadsDrafter.plain_chain`) is the reference; tests/kernels/test_draft_heads.py holds the two
equal: the same drafts where no two logits are within rounding of each other, and otherwise a draft whose logit
is within rounding of the reference's best. (addmm rounds the residual sum once where the plain chain rounds
W_down's output and then the sum: the states agree to one rounding step, not bit for bit.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specchat.kernels import dense_gemv as dense_gemv_rules
from specchat.kernels.dense_gemv_triton import dense_gemv
from specchat.kernels.draft_heads import BLOCK_K
from specchat.kernels.fused_triton import rms_normed

BLOCK_V = 64  # draft rows per program of the argmax kernel: 128 programs over the default model's 8,192
BLOCK_B = 16  # requests per program (tl.dot's smallest M)


@triton.jit
def _head_input_kernel(
    state_ptr, token_ptr, pval_ptr, pidx_ptr, vocab_ptr, embed_ptr, ws_ptr, we_ptr, u_ptr, out_ptr,
    d, parts, stride_state, stride_out, col, eps,
    FROM_PARTS: tl.constexpr, MAKE_INPUT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    if FROM_PARTS:  # the previous head's draft: the first index holding the largest of its partial maxima
        p = tl.arange(0, BLOCK_P)
        vals = tl.load(pval_ptr + row * parts + p, mask=p < parts, other=float("-inf"))
        first = tl.min(tl.where(vals == tl.max(vals, axis=0), p, BLOCK_P), axis=0)
        token = tl.load(vocab_ptr + tl.load(pidx_ptr + row * parts + first))
        tl.store(out_ptr + row * stride_out + col, token)
    else:
        token = tl.load(token_ptr + row)
    if MAKE_INPUT:  # u = [norm_s(state); norm_e(E[token])], each normalised as RMSNorm does
        cols = tl.arange(0, BLOCK_D)
        live = cols < d
        dtype = u_ptr.dtype.element_ty
        s = tl.load(state_ptr + row * stride_state + cols, mask=live, other=0.0).to(tl.float32)
        ws = tl.load(ws_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(u_ptr + row * 2 * d + cols, rms_normed(s, ws, d, eps, dtype), mask=live)
        e = tl.load(embed_ptr + token.to(tl.int64) * d + cols, mask=live, other=0.0).to(tl.float32)
        we = tl.load(we_ptr + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(u_ptr + row * 2 * d + d + cols, rms_normed(e, we, d, eps, dtype), mask=live)


@triton.jit
def _draft_argmax_kernel(
    state_ptr, wn_ptr, rows_ptr, pval_ptr, pidx_ptr, B, V, d, parts, stride_state, eps,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pv = tl.program_id(0)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    live_b, live_v = b < B, v < V
    dtype = rows_ptr.dtype.element_ty
    squares = tl.zeros([BLOCK_B], tl.float32)
    for k0 in range(0, d, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(state_ptr + b[:, None] * stride_state + k[None, :], mask=live_b[:, None] & (k < d)[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        squares += tl.sum(x * x, axis=1)
    r = 1.0 / tl.sqrt(squares / d + eps)
    acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
    for k0 in range(0, d, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        live_k = k < d
        x = tl.load(state_ptr + b[:, None] * stride_state + k[None, :], mask=live_b[:, None] & live_k[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        wn = tl.load(wn_ptr + k, mask=live_k, other=0.0).to(tl.float32)
        xn = (wn[None, :] * (x * r[:, None]).to(dtype).to(tl.float32)).to(dtype)  # the final norm, as RMSNorm
        w = tl.load(rows_ptr + v[:, None] * d + k[None, :], mask=live_v[:, None] & live_k[None, :], other=0.0)
        acc = tl.dot(xn, tl.trans(w), acc, input_precision=PRECISION)
    logits = acc.to(dtype).to(tl.float32)  # rounded as the matmul's
    # (a NaN logit is never the best: from a NaN state every index would be, and none in range is promised)
    logits = tl.where(live_v[None, :] & (logits == logits), logits, float("-inf"))
    best, at = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(pval_ptr + b * parts + pv, best, mask=live_b)
    tl.store(pidx_ptr + b * parts + pv, pv * BLOCK_V + at, mask=live_b)


def _head_input(state, token, parts, vocab, embed, block, u, out, col, from_parts, make_input):
    d = embed.shape[1]
    pval, pidx = parts
    _head_input_kernel[(out.shape[0],)](
        state, token, pval, pidx, vocab, embed, block.state_norm.weight, block.embed_norm.weight, u, out,
        d, pval.shape[1], state.stride(0), out.stride(0), col, block.state_norm.eps,
        FROM_PARTS=from_parts, MAKE_INPUT=make_input, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_P=triton.next_power_of_2(pval.shape[1]), num_warps=4,
    )  # fmt: skip


def _on_dense_gemv(u: torch.Tensor, block) -> bool:
    """Whether a head's MLP runs on kernels/dense_gemv_triton.py (a few rows of half-precision weights, on CUDA):
    W_up with the SiLU as its epilogue, W_down with the residual add as its."""
    return (
        dense_gemv_rules.ENABLED
        and u.is_cuda
        and block.act is F.silu
        and dense_gemv_rules.supported(u, block.up.weight)
        and block.down.weight.is_contiguous()
    )


def greedy_chain(
    blocks, embed: torch.Tensor, norm, rows: torch.Tensor, vocab: torch.Tensor, hidden: torch.Tensor,
    newest: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The sequential heads `blocks` (HeadBlock) from h_t [B, d] and the newest tokens [B]: their greedy drafts
    [B, len(blocks)] over the draft vocabulary `vocab` (target ids of `rows` [Vd, d]), with the target's
    embedding table and final RMSNorm `norm`. Check `draft_heads.supported` first."""
    n, d = hidden.shape
    depth, num_rows = len(blocks), rows.shape[0]
    out = torch.empty(n, depth, dtype=torch.long, device=hidden.device)
    num_parts = triton.cdiv(num_rows, BLOCK_V)
    parts = (
        torch.empty(n, num_parts, dtype=torch.float32, device=hidden.device),
        torch.empty(n, num_parts, dtype=torch.int32, device=hidden.device),
    )
    u = torch.empty(n, 2 * d, dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # (tf32: unused for half types)
    state = hidden.contiguous()
    for i, block in enumerate(blocks):
        _head_input(state, newest, parts, vocab, embed, block, u, out, i - 1, i > 0, True)
        if _on_dense_gemv(u, block):  # (two launches in the PDL chain where cuBLAS took three outside it)
            state = dense_gemv(dense_gemv(u, block.up.weight, act=True), block.down.weight, residual=state)
        else:
            state = torch.addmm(state, block.act(F.linear(u, block.up.weight)), block.down.weight.t())
        _draft_argmax_kernel[(num_parts, triton.cdiv(n, BLOCK_B))](
            state, norm.weight, rows, *parts, n, num_rows, d, num_parts, state.stride(0), norm.eps,
            BLOCK_B=BLOCK_B, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=4,
        )  # fmt: skip
    _head_input(state, newest, parts, vocab, embed, blocks[-1], u, out, depth - 1, True, False)
    return out
