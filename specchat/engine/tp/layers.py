"""The sharded model as a transform: the rank's modules wrapped so that the ranks' partial results combine.

`parallelize(model, group)` takes a model built from one rank's slices (engine.tp.shard) and swaps in, as
quant.handler swaps in Fp4Linear:
- `RowParallel` around each block's wo and w_down: the rank's partial product, then one all-reduce;
- `VocabParallelHead` around lm_head: the rank's rows of the logits, all-gathered into the whole vocabulary.

wqkv and w_gate_up need no wrapper: a column-parallel linear is an ordinary linear over the rank's rows, and the
attention and the SwiGLU that follow work per head and per unit. The wrapped module may be an nn.Linear or an
Fp4Linear; engine/model.py is untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.engine.model import Transformer
from specchat.engine.tp.group import TPGroup


class RowParallel(nn.Module):
    """y = sum over ranks of linear_r(x_r): this rank's input columns, summed by one all-reduce."""

    def __init__(self, linear: nn.Module, group: TPGroup) -> None:
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("a row-parallel linear with a bias would add it once per rank")
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / N] -> [T, out], the same on every rank."""
        return self.group.all_reduce(self.linear(x))


class VocabParallelHead(nn.Module):
    """logits = [head_0(x) | head_1(x) | ...][:, :vocab]: each rank's vocabulary rows, all-gathered."""

    def __init__(self, linear: nn.Module, group: TPGroup, vocab_size: int) -> None:
        super().__init__()
        self.linear = linear
        self.group = group
        self.vocab_size = vocab_size

    @property
    def weight(self) -> torch.Tensor:
        """This rank's rows of the head [vocab / N, hidden] (what a drafter reads for the device and dtype)."""
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> logits [T, vocab], the same on every rank."""
        parts = self.group.all_gather(self.linear(x).contiguous())  # N x [T, vocab / N]
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def parallelize(model: Transformer, group: TPGroup) -> Transformer:
    """Wrap a rank's model (built from its slices) so that its forward computes the unsharded model's."""
    for block in model.layers:
        block.attn.wo = RowParallel(block.attn.wo, group)
        block.mlp.w_down = RowParallel(block.mlp.w_down, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, model.cfg.vocab_size)
    return model
