"""Random MXFP4 weights and the float64 reference matmul, shared by the MXFP4 matmul tests."""

from __future__ import annotations

import torch

from specchat.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def random_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [N, K] weight with block scales spread over 2^-10..2^2 (above 2: an exponent offset), codes, scales."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * torch.logspace(-10, 2, n, base=2.0)[:, None]
    return (w, *quantize_mxfp4(w))


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """x @ dequantize_mxfp4(W)^T in float64."""
    return x.double() @ dequantize_mxfp4(codes, scales, k=k).double().T


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()
