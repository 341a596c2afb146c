"""The CPU decode step's elementwise work around the linears, in C: RMSNorm (with the residual add), RoPE, SiLU-mul
(attention over the paged KV cache: kernels/cpu_attention.py, built on this module's C helpers, csrc/cpu_ops.h).

A decode step of a small model on a CPU spends more time between its linears than in them when each of those
steps is a chain of torch ops: ~90 aten calls per layer of a few microseconds each, on vectors of a few hundred
floats (docs/benchmarks.md, issue 20). Here each is one call through ctypes, on float32 rows in place:

- `rms_norm` / `add_rms_norm`: y = w * (x * rsqrt(mean(x^2) + eps)), rounded in RMSNorm.forward's order; the
  second adds the residual first (s = x + delta) and returns s too.
- `rope_qk`: rotary embeddings, "rotate half" layout (model.apply_rope): o_i = x_i cos_i - x_{i+D/2} sin_i and
  o_{i+D/2} = x_{i+D/2} cos_{i+D/2} + x_i sin_{i+D/2}: the same products and sums as the torch reference, so
  the same bits (no fused multiply-adds: -ffp-contract=off).
- `silu_mul`: [gate | up] -> gate / (1 + exp(-gate)) * up; `silu`: x / (1 + exp(-x)).

exp is Cephes' single-precision polynomial (within ~1 ulp of torch's Sleef exp, not bit-equal), written so the
compiler vectorizes it; reductions (sums of squares here, dot products and softmax sums in attention) use a fixed
order of their own, so results differ from torch's in the last bits, and every row is computed alone and the
same way whatever the batch: a token's values do not depend on the other tokens of its step (verification
stays batch-invariant).
Each kernel has its plain torch reference here (`*_ref`); tests/kernels/test_cpu_ops.py holds them together.
Compiled once by kernels/cpu_build.py; `available()` is False where that fails and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch
import torch.nn.functional as F

from specchat.kernels import cpu_build, fused

# The C of these kernels (csrc/): cpu_ops.h, the includes, macros and inline helpers the other modules' C builds on
# (C_HEADER), then cpu_ops.c, the functions bound below.
C_HEADER = cpu_build.c_source("cpu_ops.h")
C_SOURCE = C_HEADER + cpu_build.c_source("cpu_ops.c")

# -O3 and the host's vector units; no contraction into fused multiply-adds beyond the ones written, so RoPE and
# the residual add round as the torch reference does.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load_part("cpu_ops", C_SOURCE, CFLAGS)
    if lib is None:
        return None
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.rms_norm.argtypes = [i32, i32, ptr, ptr, f32, ptr]
    lib.add_rms_norm.argtypes = [i32, i32, ptr, ptr, ptr, f32, ptr, ptr]
    lib.rope_qk.argtypes = [i32, i32, i32, i32, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.silu_mul.argtypes = [i32, i32, ptr, ptr]
    lib.silu.argtypes = [i32, i32, ptr, ptr]
    lib.argmax_rows.argtypes = [i32, i64, ptr, ptr, i32]
    lib.argmax_rows.restype = ctypes.c_int
    for fn in (lib.rms_norm, lib.add_rms_norm, lib.rope_qk, lib.silu_mul, lib.silu):
        fn.restype = None
    return lib


def available() -> bool:
    """Whether the compiled kernels load on this machine."""
    return _library() is not None


def supported(x: torch.Tensor) -> bool:
    """The kernels take float32 tensors on the CPU, where no gradient is recorded (they have no backward: training
    draft heads through the target's norm and head keeps the torch ops)."""
    return x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled() and _library() is not None


def _rows(x: torch.Tensor, n: int) -> int:
    """Rows of a contiguous float32 [..., n] tensor (checked)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[-1] == n and not x.is_cuda, (x.dtype, x.shape)
    return x.numel() // n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] float32 -> weight * x / rms(x) (model.RMSNorm)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    _rows(weight, n)
    out = torch.empty_like(x)
    _library().rms_norm(rows, n, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s)) with s = x + delta, both [..., N] float32 (the residual add of a block, then its norm)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    assert _rows(delta, n) == rows and _rows(weight, n) == 1, (delta.shape, weight.shape)
    total, out = torch.empty_like(x), torch.empty_like(x)
    _library().add_rms_norm(
        rows, n, x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, total.data_ptr(), out.data_ptr()
    )
    return total, out


def heads_view(x: torch.Tensor, shape: tuple[int, ...]) -> int:
    """Row stride (floats) of a float32 CPU x of `shape` [T, heads, D] whose heads lie next to each other in a row
    (a split of a fused projection's output qualifies). The wrappers run ~120 times a token: one look at the
    shape and strides each."""
    stride = x.stride()
    assert x.shape == shape and stride[2] == 1 and stride[1] == shape[2], (x.shape, shape, stride)
    assert x.dtype == torch.float32 and x.is_cpu, (x.dtype, x.device)
    return stride[0]


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] rotated by cos/sin [T, D] (model.apply_rope) -> new contiguous tensors."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    q_stride, k_stride = heads_view(q, (t, heads, d)), heads_view(k, (t, kv_heads, d))
    assert d % 2 == 0 and _rows(cos, d) == t and _rows(sin, d) == t, (d, cos.shape, sin.shape)
    q_out, k_out = torch.empty(t, heads, d), torch.empty(t, kv_heads, d)
    _library().rope_qk(
        t, heads, kv_heads, d, q.data_ptr(), q_stride, k.data_ptr(), k_stride,
        cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I] (model.SiluAndMul)."""
    n = gate_up.shape[-1] // 2
    rows = _rows(gate_up, 2 * n)
    out = torch.empty(*gate_up.shape[:-1], n)
    _library().silu_mul(rows, n, gate_up.data_ptr(), out.data_ptr())
    return out


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu(x) for a float32 [..., N] tensor (the draft heads' activation where they read GGUF blocks)."""
    n = x.shape[-1]
    rows = _rows(x, n)
    out = torch.empty_like(x)
    _library().silu(rows, n, x.data_ptr(), out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), in C for a float32 CPU tensor, each thread over the columns it wrote (torch's took ~90 us over
    a 49,152-entry row of logits inside a decoding step on a 2-core Xeon); on CUDA in the two launches of
    kernels/argmax_triton.py (torch's took 13 us of a 0.8 ms step on an H100); any other tensor goes to torch."""
    if fused.argmax_supported(x):
        from specchat.kernels import argmax_triton  # (CUDA only: a CPU process never imports Triton)

        return argmax_triton.argmax_rows(x)
    n = x.shape[-1] if x.dim() else 0
    # (grad mode does not matter here, unlike for `supported`'s kernels: an index carries no gradient; the engine
    # verifies outside inference mode)
    if n == 0 or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or _library() is None:
        return x.argmax(-1)
    out = torch.empty(x.shape[:-1], dtype=torch.int64)
    if _library().argmax_rows(x.numel() // n, n, x.data_ptr(), out.data_ptr(), torch.get_num_threads()) != 0:
        return x.argmax(-1)  # (no memory for the per-thread results)
    return out


# --- the plain references ---------------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm_ref(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_ref(total, weight, eps)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D]: x cos + rotate_half(x) sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
