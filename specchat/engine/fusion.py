"""The fused elementwise kernels as a transform of the model (docs/style.md #3): swap modules in, swap them out.

`fuse(model)` re-classes the model's `RMSNorm`, `Rotary` and `SiluAndMul` modules (engine/model.py) as the
subclasses below, whose forward runs the Triton kernel of kernels/fused.py where it is supported (CUDA, or the
CPU under TRITON_INTERPRET=1) and the plain module's forward otherwise; `unfuse(model)` swaps them back. The
parameters and state stay the same objects, so a model can be fused after loading and unfused for checking.
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.engine.model import RMSNorm, Rotary, SiluAndMul
from specchat.kernels import fused


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused.rms_norm_supported(x, self.weight):
            return super().forward(x)
        return fused.rms_norm(x, self.weight, self.eps)


class FusedRotary(Rotary):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not fused.rope_qk_supported(q):
            return super().forward(q, k, cos, sin)
        return fused.rope_qk(q, k, cos, sin)


class FusedSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused.silu_mul_supported(x):
            return super().forward(x)
        return fused.silu_mul(x)


FUSED = {RMSNorm: FusedRMSNorm, Rotary: FusedRotary, SiluAndMul: FusedSiluAndMul}
PLAIN = {fused_cls: plain for plain, fused_cls in FUSED.items()}


def swap_classes(model: nn.Module, mapping: dict[type, type]) -> int:
    """Re-class matching modules in place (same parameters, same state): returns how many were swapped (the CUDA
    and the CPU fusions both)."""
    swapped = 0
    for module in model.modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            swapped += 1
    return swapped


def fuse(model: nn.Module) -> int:
    """Use the fused kernels in `model` (where its tensors are on CUDA); returns the number of modules swapped."""
    return swap_classes(model, FUSED)


def unfuse(model: nn.Module) -> int:
    """Back to the plain PyTorch modules."""
    return swap_classes(model, PLAIN)
