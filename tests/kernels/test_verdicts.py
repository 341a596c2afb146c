"""The one-launch greedy verdicts (kernels/verdicts_triton.py) against engine/verify.py's greedy_verdicts and the
indexing after it.

Kernel tests run on CUDA, or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file in
a subprocess with it set).
"""

from __future__ import annotations

import pytest
import torch

from specchat.engine.verify import greedy_verdicts as reference
from specchat.kernels.verdicts_triton import BLOCK_B, greedy_verdicts
from tests.kernels.interpreter import DEVICE, kernel_test, run_under_interpreter, subprocess_test


@kernel_test
@pytest.mark.parametrize("q", [1, 2, 5, 9])
@pytest.mark.parametrize("n", [1, 3, BLOCK_B + 5])
def test_verdicts_equal_the_reference(n: int, q: int) -> None:
    g = torch.Generator().manual_seed(n * 10 + q)
    target = torch.randint(0, 50, (n, q), generator=g)
    fed = torch.randint(0, 50, (n, q), generator=g)
    # each request's drafts right up to a depth of its own (0 .. q - 1), wrong after it
    for b in range(n):
        depth = int(torch.randint(0, q, (1,), generator=g))
        fed[b, 1 : depth + 1] = target[b, :depth]
        if depth + 1 < q:
            fed[b, depth + 1] = target[b, depth] + 1
    target, fed = target.to(DEVICE), fed.to(DEVICE)
    accepted, newest, flat = greedy_verdicts(target, fed)
    want = reference(target, fed)
    rows = torch.arange(n, device=DEVICE)
    assert torch.equal(accepted, want)
    assert torch.equal(newest, target[rows, want])
    assert torch.equal(flat, rows * q + want)
    hidden = torch.randn(n, q, 4, generator=g).to(DEVICE)
    assert torch.equal(hidden.flatten(0, 1).index_select(0, flat), hidden[rows, want])  # (how the taps are read)


@kernel_test
def test_strided_rows() -> None:
    packed = torch.tensor([[0, 5, 6, 5], [0, 5, 9, 7]], device=DEVICE)  # target columns 1..2, fed columns 2..3
    target, fed = packed[:, 1:3], packed[:, 2:4]
    accepted, newest, flat = greedy_verdicts(target, fed)
    assert accepted.tolist() == [1, 0] and newest.tolist() == [6, 5] and flat.tolist() == [1, 2]


@subprocess_test
def test_kernels_under_interpreter() -> None:
    run_under_interpreter([__file__], "not interpreter")
