"""Running Triton kernel tests on a CPU: under TRITON_INTERPRET=1, which must be set before triton loads.

Kernel tests carry `kernel_test`: they run directly on a CUDA machine or in a process that has the variable set.
On a plain CPU machine each kernel test module has one test that reruns its kernel tests in a subprocess with
the variable set, through `run_under_interpreter`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernel_test = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1 (run by the subprocess test)"
)
subprocess_test = pytest.mark.skipif(
    INTERPRET or torch.cuda.is_available(), reason="the kernel tests run directly here"
)


def run_under_interpreter(files: list[str], select: str) -> None:
    """Run `pytest -k select` over files with TRITON_INTERPRET=1 in a subprocess; fail with its output."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, *files],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
