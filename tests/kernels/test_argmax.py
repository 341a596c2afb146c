"""The GPU argmax (kernels/argmax_triton.py) against torch.argmax: the same index, ties and NaNs included.

Kernel tests run on CUDA, or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file in
a subprocess with it set; the interpreter has no bf16, so there the tests take float16 and float32).
"""

from __future__ import annotations

import pytest
import torch

from specchat.kernels.argmax_triton import BLOCK_V, argmax_rows
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "v"), [(1, 49152), (5, 49152), (3, 100), (2, BLOCK_V), (4, 3 * BLOCK_V + 7)])
def test_argmax_equals_torch(rows: int, v: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * v)
    x = torch.randn(rows, v, generator=g).to(dtype).to(DEVICE)
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(-1))


@kernel_test
def test_ties_go_to_the_first_index_and_nans_win() -> None:
    v = 3 * BLOCK_V + 5
    x = torch.zeros(6, v, device=DEVICE)
    x[0, [7, BLOCK_V + 3, 2 * BLOCK_V]] = 2.0  # a tie across parts: the first
    x[1, [BLOCK_V + 9, BLOCK_V + 4]] = 3.0  # a tie within a part
    x[2] = float("-inf")  # every entry alike: index 0
    x[3, [5, 2 * BLOCK_V + 1]] = float("nan")  # NaN is the largest: the first one
    x[3, 9] = float("inf")
    x[4, v - 1] = float("nan")  # a NaN in the last, partial part
    x[5, [3, v - 1]] = float("inf")
    want = torch.tensor([7, BLOCK_V + 4, 0, 5, v - 1, 3], device=DEVICE)
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(x.argmax(-1), want)  # (what torch itself answers)


@kernel_test
def test_leading_dims_and_strided_rows() -> None:
    x = torch.randn(2, 3, 4 * BLOCK_V, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    wide = torch.randn(5, 2 * 700, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rows = wide[:, :700]  # rows of stride 1,400
    assert torch.equal(argmax_rows(rows), rows.argmax(-1))
    assert argmax_rows(wide[:0]).shape == (0,)


def test_what_it_takes() -> None:
    """CUDA tensors of the dtypes it compares exactly in float32; float64 (which it would round), CPU tensors
    (which have their C argmax) and rows of another stride stay with their own paths."""
    from specchat.kernels.fused import argmax_supported

    x = torch.zeros(2, 8)
    assert not argmax_supported(x)  # (the CPU)
    if torch.cuda.is_available():
        assert argmax_supported(x.cuda()) and argmax_supported(x.cuda().half())
        assert not argmax_supported(x.cuda().double()) and not argmax_supported(x.cuda().t())


@subprocess_test
def test_kernels_under_interpreter() -> None:
    run_under_interpreter([__file__], "not interpreter")
