"""Programmatic dependent launch (PDL) for the step's Triton kernels, on Hopper and newer.

A decode step at batch 1 is a chain of short kernels (per layer: norm, the QKV matmul, rotary + KV write,
attention, its merge, the output matmul, norm, gate_up, SiLU-and-mul, down). Each waits for the one before it to
finish, so every boundary costs the next kernel's launch, its programs' start and the ramp of its first loads.
With PDL a kernel is launched while the one before it still runs (`launch_pdl=True` on its launch; inside a CUDA
graph the edge becomes a programmatic one). A kernel calls, from kernels/pdl_triton.py:

- `launch_dependents(PDL)` (griddepcontrol.launch_dependents): once every program of this kernel has passed it,
  the next PDL kernel of the stream may launch. Kernels here call it first thing.
- `wait(PDL)` (griddepcontrol.wait): blocks until the kernel before has completed and its writes are visible.
  Transitively everything before that too: the kernel before could only finish after its own wait.

The rule each PDL kernel keeps: **before `wait(PDL)` it reads and writes no memory that another kernel writes**.
The only work there is `prefetch_l2` of constant data (a matmul's weights), so those bytes are on their way to the
L2 while the kernel before still runs. A kernel launched without the attribute (torch's, cuBLAS) waits as always,
and `wait` is a no-op where nothing is pending, so PDL kernels mix freely with other work.

`enabled(device)` (`launch_options` for a launch): CUDA with compute capability >= 9.0, not under
TRITON_INTERPRET=1, SPECCHAT_PDL not "0", and asked for: by `scope(True)`, which the CUDA-graph runner opens
around its steps where the layers' linears are MXFP4 kernels, or by `override(True)` (tests and A/B benchmarks:
benchmarks/pdl_gpu.py; it wins over scope).
Measured on the H200 (docs/benchmarks.md, "Eighth lease"): 1.02-1.05x at batch 1 with MXFP4 weights, where
every kernel of a layer is ours; 0.97-0.99x where cuBLAS runs the linears between them (bf16 weights), so those
steps launch as before. Every kernel takes the same flag as its `PDL` constexpr and its `launch_pdl`; with it off
the kernels compile exactly as before. This module is the host side (the CUDA-graph runner's `scope` is on the
CPU path too): it imports no Triton.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

ENV = "SPECCHAT_PDL"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_FROM_ENV = os.environ.get(ENV, "1") != "0"
_override: bool | None = None  # set by `override` (wins)
_scoped = False  # set by `scope`


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (cheap: called on every launch)."""
    if _INTERPRET or device.type != "cuda":
        return False
    on = _scoped if _override is None else _override
    return (
        on and _FROM_ENV and _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())
    )


def launch_options(device: torch.device) -> dict[str, bool]:
    """The kernel's `PDL` constexpr and Triton's `launch_pdl`, which must agree: `kernel[grid](..., **this)`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on}


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Within the block, PDL on or off as the caller (a runner, for its model) asks, unless `override` says."""
    global _scoped
    before, _scoped = _scoped, on
    try:
        yield
    finally:
        _scoped = before


@contextlib.contextmanager
def override(on: bool | None) -> Iterator[None]:
    """Within the block, PDL on or off whatever `scope` asks (None: as it asks). Graphs captured inside keep the
    setting they were captured with."""
    global _override
    before, _override = _override, on
    try:
        yield
    finally:
        _override = before
