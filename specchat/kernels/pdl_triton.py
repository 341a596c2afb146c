"""The device side of programmatic dependent launch (kernels/pdl.py): what a PDL kernel calls.

`wait`, `launch_dependents` and `prefetch_l2` are Triton functions that the kernels call with their `PDL`
constexpr (`pdl.launch_options` gives it): with it off they compile to nothing. See kernels/pdl.py for the rule
each PDL kernel keeps.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible (PDL only)."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next PDL kernel of the stream launch once every program has passed here (PDL only)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask the L2 to fetch the lines at `ptrs` (a tensor of pointers), without waiting for them (CUDA only; worth
    its instructions where a kernel before still runs: under PDL)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )
