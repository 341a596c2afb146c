"""Fp4Linear: a drop-in for nn.Linear whose weight lives only as MXFP4 (OCP MX v1.0) codes and scales.

The module's resident tensors are the packed E2M1 codes (two per byte) and the E8M0 block scales (one per 32
weights), plus the bias if any: 4.25 bits per weight. `forward` is `kernels.mxfp4_matmul.mxfp4_linear`: the
Triton dequant-matmul on CUDA (codes and scales in the kernel's layout, made once by `prepare_weight`), and on
the CPU a dequantization into a scratch buffer shared by all layers followed by F.linear, so no dense copy of
the weight outlives a call.
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.kernels.mxfp4 import Rule, dequantize_mxfp4, quantize_mxfp4
from specchat.kernels.mxfp4_matmul import Mxfp4Weight, mxfp4_linear, prepare_weight, unprepare_weight


class Fp4Linear(nn.Module):
    """y = x @ dequant(W)^T + b with W [out_features, in_features] held as MXFP4 only."""

    def __init__(self, weight: Mxfp4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.k, weight.n
        self.register_buffer("codes", weight.codes)  # CPU: uint8 [N, Kp/2]; CUDA: the kernel's int32 words
        self.register_buffer("scales", weight.scales)  # CPU: uint8 [N, Kp/32]; CUDA: the kernel's layout
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._layout = (weight.prepared, weight.exp_offset, weight.has_nan)

    @classmethod
    def from_packed(
        cls, codes: torch.Tensor, scales: torch.Tensor, in_features: int, bias: torch.Tensor | None = None
    ) -> Fp4Linear:
        """From interchange codes uint8 [N, Kp/2] and scales uint8 [N, Kp/32], laid out for their device."""
        return cls(prepare_weight(codes, scales, k=in_features), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rule: Rule = "mse") -> Fp4Linear:
        """Round-to-nearest quantization of a dense Linear (on its device)."""
        codes, scales = quantize_mxfp4(linear.weight.detach(), rule=rule)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_packed(codes, scales, linear.in_features, bias)

    @property
    def weight_mxfp4(self) -> Mxfp4Weight:
        """The packed weight as the matmul reads it (a view of this module's buffers)."""
        prepared, exp_offset, has_nan = self._layout
        return Mxfp4Weight(self.out_features, self.in_features, self.codes, self.scales, prepared, exp_offset, has_nan)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Interchange (codes uint8 [N, Kp/2], scales uint8 [N, Kp/32]), e.g. to save a checkpoint."""
        return unprepare_weight(self.weight_mxfp4)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values [N, K] in `dtype` (exact in float32: every MXFP4 value is a float32)."""
        codes, scales = self.packed()
        return dequantize_mxfp4(codes, scales, dtype, k=self.in_features)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """A dense nn.Linear holding the dequantized weight."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.dequantized(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weight (codes + scales, with any kernel-layout padding)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp4_linear(x, self.weight_mxfp4, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
