"""gpt-fast's int4 weight-only linear, the yardstick `bench --synthetic --weights int4` runs beside MXFP4.

gpt-fast (pytorch-labs) quantizes each linear of its int4 model in groups of 32 weights along the input dimension,
asymmetrically: per group a scale s = (max - min) / 15 and a zero z = min + 8 s, codes q = round((w - min) / s) in
0..15, so that w ~ (q - 8) s + z; the codes are packed for torch's tinygemm kernel (`_weight_int4pack_mm`, bf16
activations) with 8 inner k-tiles (fewer where K needs it), the scales and zeros as one [K / 32, N, 2] bf16 tensor. This module does the
same (on a CPU through the `_for_cpu` variants of the same ops), so the synthetic bench carries the peer in the
same run. It is a benchmark yardstick, not a weight format of the product (that is MXFP4: docs/mxfp4.md).
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.quant.modules import linear_names, swap_modules

GROUP = 32
INNER_K_TILES = (8, 4, 2)  # tinygemm's packing: the largest that divides K / 16 (gpt-fast's 8 on the 8B shapes)


def quantize_groups(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes [N, K] int32 in 0..15, scales_and_zeros [K / group, N, 2] bf16), gpt-fast's rule."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scales = (high - low).clamp(min=1e-6) / 15
    zeros = low + scales * 8
    codes = ((w - low) / scales).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return codes, scales_zeros


def dequantize_groups(codes: torch.Tensor, scales_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The reference: (q - 8) s + z, [N, K] float32."""
    n, k = codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [N, K / group, 2]
    q = codes.float().reshape(n, k // group, group)
    return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


class Int4Linear(nn.Module):
    """y = x W^T with W in gpt-fast's int4 g32 layout, through torch's tinygemm kernel (bf16 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        tiles = next((t for t in INNER_K_TILES if self.in_features % (t * 16) == 0), None)
        if tiles is None or self.in_features % GROUP or self.out_features % 8:
            raise ValueError(
                f"int4 tinygemm needs K divisible by 32 and N by 8, got {self.in_features} x {self.out_features}"
            )
        codes, scales_zeros = quantize_groups(weight)
        if weight.is_cuda:
            packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
            packed = torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, tiles)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros.to(weight.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if rows.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, GROUP, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def quantize_int4(model: nn.Module) -> None:
    """Every linear of the model to Int4Linear in place, the output head included (as gpt-fast's int4 model);
    the embedding stays dense (a tied head gets its own int4 copy)."""
    modules = {}
    for name in linear_names(model):
        linear = model.get_submodule(name)
        modules[name] = Int4Linear(linear.weight.detach(), linear.bias)
    swap_modules(model, modules)
