"""The CPU kernels of kernels/cpu_ops.py as a transform of the model (docs/style.md #3, #6): swap modules in and out.

`fuse(model)` re-classes a float32 CPU model's `Block`, `RMSNorm`, `Rotary` and `SiluAndMul` modules
(engine/model.py) as the subclasses below, whose forward calls one C kernel where the plain one runs a chain of
torch ops; `CpuBlock` also adds each residual in the same pass as the norm that follows it. Attention itself
goes through the KV batch, which takes the C paged-attention kernel when its pool was built with
`cpu_kernels` (engine/kv_batch.py). `unfuse(model)` swaps the plain modules back; parameters and state stay the
same objects. `--eager` never fuses (engine/loading.py): that is the reference the tests hold this path to.
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.engine.model import Block, KVAttention, RMSNorm, Rotary, SiluAndMul
from specchat.kernels import cpu_ops


class CpuRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.supported(x):
            return super().forward(x)
        return cpu_ops.rms_norm(x.contiguous(), self.weight, self.eps)


class CpuRotary(Rotary):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not cpu_ops.supported(q):
            return super().forward(q, k, cos, sin)
        return cpu_ops.rope_qk(q, k, cos, sin)


class CpuSiluAndMul(SiluAndMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.supported(gate_up):
            return super().forward(gate_up)
        return cpu_ops.silu_mul(gate_up.contiguous())


class CpuBlock(Block):
    """Block with the attention's residual add and the MLP's norm in one kernel: x + attn(norm(x)) -> (s,
    norm(s)) in one pass over the row."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        if not cpu_ops.supported(x):
            return super().forward(x, cos, sin, kv)
        norm = self.mlp_norm
        delta = self.attn(self.attn_norm(x), cos, sin, kv).contiguous()
        x, h = cpu_ops.add_rms_norm(x.contiguous(), delta, norm.weight, norm.eps)
        return x + self.mlp(h)


FUSED = {Block: CpuBlock, RMSNorm: CpuRMSNorm, Rotary: CpuRotary, SiluAndMul: CpuSiluAndMul}
PLAIN = {fused: plain for plain, fused in FUSED.items()}


def _swap_classes(model: nn.Module, mapping: dict[type, type]) -> int:
    swapped = 0
    for module in model.modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            swapped += 1
    return swapped


def fuse(model: nn.Module) -> int:
    """Use the CPU kernels in a float32 CPU model (none where they do not load); returns the modules swapped."""
    param = next(model.parameters())
    if param.dtype != torch.float32 or param.device.type != "cpu" or not cpu_ops.available():
        return 0
    return _swap_classes(model, FUSED)


def unfuse(model: nn.Module) -> int:
    """Back to the plain PyTorch modules."""
    return _swap_classes(model, PLAIN)
