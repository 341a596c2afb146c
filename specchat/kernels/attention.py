"""Attention over a request's cached context: the plain torch reference.

Terms: a request feeds `q_len` new tokens whose keys/values are already stored, so its context holds
`ctx_len >= q_len` tokens and the new tokens sit at its end. New token i (0-based) sees context positions
0 .. ctx_len - q_len + i (causal). Grouped-query attention: query head h reads KV head h // (H / KVH).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, H, D], k/v [ctx_len, KVH, D] -> [q_len, H, D]; the q rows are the last q_len positions."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, D]
    mask = None
    if q_len > 1:
        # row i may see columns <= ctx_len - q_len + i
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows  # [q_len, ctx_len]
    out = F.scaled_dot_product_attention(
        qh, kh.to(q.dtype), vh.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)  # [q_len, H, D]
