"""Attention over paged KV: the plain torch reference, and where the Triton kernel (decode, verification) runs.

Terms: a request feeds `q_len` new tokens whose keys/values are already stored, so its context holds
`ctx_len >= q_len` tokens and the new tokens sit at its end. New token i (0-based) sees context positions
0 .. ctx_len - q_len + i (causal). Grouped-query attention: query head h reads KV head h // (H / KVH).
Pages: context position p of a request lives in slot table[p // page_size] * page_size + p % page_size of
its layer's `PageTensor` rows (see kv_quant), in any element format (dense, MXFP4, MXFP8).

The kernel is in kernels/attention_triton.py, imported at its first launch: the CPU path, which attends through
the reference or the C kernels of kernels/cpu_attention.py, never imports Triton (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specchat.kernels.kv_quant import PageTensor

MAX_BLOCK_M = 128  # query rows per program: q_len x (H / KVH) must fit
MAX_HEAD_DIM = 256
MAX_GROUPED_Q = 32  # the reference attends with plain matmuls up to this many new tokens (decode, verification)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, H, D], k/v [KVH, ctx_len, D] -> [q_len, H, D]; the q rows are the last q_len positions."""
    q_len, num_heads, head_dim = q.shape
    kv_heads, ctx_len = k.shape[:2]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if q_len > MAX_GROUPED_Q:  # prompts: SDPA's fused kernels (no [q_len, ctx_len] matrix)
        qh = q.transpose(0, 1)[None]  # [1, H, q_len, D]: the fused kernels take 4-d inputs only (3-d runs the math one)
        if q_len == ctx_len:  # a fresh prompt: flash attention, which reads the KV heads in place (GQA)
            out = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        else:  # a prompt after cached context: the memory-efficient kernel with the mask, over repeated KV heads
            group = num_heads // kv_heads
            k, v = (t.repeat_interleave(group, dim=0)[None] for t in (k, v))
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=_causal_mask(q_len, ctx_len, q.device), scale=scale
            )
        return out[0].transpose(0, 1)
    # Decode and verification: the group's H/KVH query heads x q_len tokens become the rows of one score matrix
    # per KV head, so keys and values are read in place instead of being repeated for every query head. On the CPU
    # a bfloat16 step attends in float32: torch's bf16 bmm there is slower than its float32 one (a bf16 model's
    # decode 84 -> 57 us a layer, a 6-row verification 153 -> 113, with the mask below; docs/benchmarks.md,
    # "Forty-first session").
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    group = num_heads // kv_heads
    rows = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, head_dim)
    scores = torch.bmm(rows, k.transpose(1, 2)).float() * scale  # [KVH, G * q_len, ctx_len]
    if q_len > 1:  # row i of the new tokens sees the context and new tokens 0..i: mask the last q_len columns only
        tail = scores.view(kv_heads, group, q_len, ctx_len)[..., ctx_len - q_len :]
        tail.masked_fill_(torch.ones(q_len, q_len, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    out = torch.bmm(scores.softmax(dim=-1).to(v.dtype), v)  # [KVH, G * q_len, D]
    return out.view(kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(dtype)


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """[q_len, ctx_len] bool: new token i sees context positions <= ctx_len - q_len + i."""
    rows = torch.arange(q_len, device=device)[:, None] + (ctx_len - q_len)
    return torch.arange(ctx_len, device=device)[None, :] <= rows


@dataclass(slots=True)
class AttentionMetadata:
    """Where each request of a ragged batch sits: its query rows, its context and its pages."""

    block_tables: torch.Tensor  # [B, max pages] int32, padded with 0
    q_starts: torch.Tensor  # [B] int32: first row of each request in the flat query [T, H, D]
    q_lens: torch.Tensor  # [B] int32
    ctx_lens: torch.Tensor  # [B] int32
    max_q_len: int
    max_ctx_len: int
    page_size: int

    @classmethod
    def build(
        cls, tables: list[list[int]], q_lens: list[int], ctx_lens: list[int], page_size: int, device
    ) -> AttentionMetadata:
        width = max(1, max(len(t) for t in tables))
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [sum(q_lens[:i]) for i in range(len(q_lens))]

        def ints(values):
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return cls(ints(padded), ints(starts), ints(q_lens), ints(ctx_lens), max(q_lens), max(ctx_lens), page_size)

    @property
    def batch_size(self) -> int:
        return self.q_lens.shape[0]


def paged_attention_reference(
    q: torch.Tensor, k_pages: PageTensor, v_pages: PageTensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: each request's context read back from its pages, attention in float32."""
    out = torch.empty_like(q)
    tables, starts = meta.block_tables.long().cpu(), meta.q_starts.tolist()
    for b, (start, q_len, ctx_len) in enumerate(zip(starts, meta.q_lens.tolist(), meta.ctx_lens.tolist(), strict=True)):
        pos = torch.arange(ctx_len)
        slots = (tables[b, pos // meta.page_size] * meta.page_size + pos % meta.page_size).to(q.device)
        k = k_pages.read(slots, torch.float32)  # [KVH, ctx_len, D]
        v = v_pages.read(slots, torch.float32)
        rows = slice(start, start + q_len)
        out[rows] = causal_attention(q[rows].float(), k, v, scale).to(q.dtype)
    return out


def paged_attention_supported(head_dim: int, group: int, max_q_len: int) -> bool:
    """Whether the kernel takes this shape (otherwise use the reference)."""
    return head_dim & (head_dim - 1) == 0 and 32 <= head_dim <= MAX_HEAD_DIM and group * max_q_len <= MAX_BLOCK_M


def fill_partitions(batch_heads: int, sms: int, resident: int, per_sm: int, max_q_len: int) -> int:
    """Context slices per (request, KV head) for a grid that fills whole waves of the GPU.

    A wave is every SM holding `resident` programs (what its registers and shared memory allow). Decode
    (one query row per request) aims at `per_sm` programs per SM, rounded to whole waves; verification (more
    rows) at one wave. H200, 32k context (docs/benchmarks.md, twenty-fourth session): a grid 9% past a wave
    runs its last programs as a second wave of their own (bf16 pages, q = 5, batch 8: 9 partitions 338 us, 8
    partitions 257), and verification rows over MXFP4 pages ran 1.5x faster in one wave than in four (batch 1:
    80 -> 54 us).
    """
    slots = resident * sms
    waves = 1 if max_q_len > 1 else max(1, round(per_sm / resident))
    return max(1, waves * slots // batch_heads)
