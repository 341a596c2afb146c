"""Where the step's small Triton kernels run: the one-pass kernels of kernels/fused_triton.py (RMSNorm, rotary
embedding, SiLU-and-mul), the argmax of kernels/argmax_triton.py and the greedy verdicts of kernels/verdicts_triton.py.

Each kernel has a `*_supported` check here: where it runs (CUDA, or the CPU under TRITON_INTERPRET=1) and the
dtypes and shapes it takes. The checks live apart from the kernels so that the CPU path, which asks them and is
told no, never imports Triton (docs/architecture.md). engine/fusion.py swaps the model's plain modules for ones
that ask these and launch the kernels where they say yes; the plain modules in engine/model.py are the references.
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton itself does


def _runs_on(x: torch.Tensor) -> bool:
    """Whether Triton can run a kernel on x's device: CUDA, or the CPU under the interpreter."""
    return x.is_cuda or (INTERPRET and x.device.type == "cpu")


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these: a Triton device and the weight in x's dtype."""
    return _runs_on(x) and weight.dtype == x.dtype


def rope_qk_supported(q: torch.Tensor) -> bool:
    """Whether `rope_qk` takes q: a Triton device, a power-of-two head_dim (tl.arange), not float64."""
    head_dim = q.shape[-1]
    return _runs_on(q) and (head_dim & (head_dim - 1)) == 0 and q.dtype != torch.float64


def silu_mul_supported(x: torch.Tensor) -> bool:
    """Whether `silu_mul` takes x: a Triton device, not float64."""
    return _runs_on(x) and x.dtype != torch.float64


def argmax_supported(x: torch.Tensor) -> bool:
    """Whether kernels/argmax_triton.py's `argmax_rows` takes x [..., V]: CUDA (the CPU has its C argmax), a float
    dtype it compares exactly in float32 (not float64), unit stride along V."""
    n = x.shape[-1] if x.dim() else 0
    return x.is_cuda and n > 0 and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.stride(-1) == 1


def verdicts_supported(target: torch.Tensor, fed: torch.Tensor) -> bool:
    """Whether kernels/verdicts_triton.py's `greedy_verdicts` takes a step's argmax targets and fed tokens [B, q]:
    a Triton device, unit strides along q."""
    return _runs_on(target) and target.dim() == 2 and target.stride(1) == 1 and fed.stride(-1) == 1
