"""Where the draft heads' greedy chain runs in four or five launches a head (its kernels: kernels/draft_heads_triton.py).

`HeadsDrafter.greedy_chain` asks `supported` on every device, the CPU included: it lives apart from the kernels so
that the CPU path never imports Triton (docs/architecture.md).
"""

from __future__ import annotations

import torch

from specchat.kernels.fused import INTERPRET, _runs_on

BLOCK_K = 64  # columns of the state per dot


def supported(hidden: torch.Tensor, blocks, embed: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether `greedy_chain` takes these: a Triton device (CUDA; the CPU only under the interpreter, in fp32:
    it has no bf16 dot), sequential heads, one dtype throughout, a state width that is a whole number of dots."""
    dtype = hidden.dtype
    if not _runs_on(hidden) or (INTERPRET and hidden.device.type == "cpu" and dtype != torch.float32):
        return False
    return (
        len(blocks) > 0
        and all(b.embed_norm is not None for b in blocks)
        and embed.dtype == rows.dtype == blocks[0].up.weight.dtype == dtype
        and hidden.shape[1] % BLOCK_K == 0
        and embed.is_contiguous()
        and rows.is_contiguous()
    )
