"""kernels/pdl.py: where programmatic dependent launch is on (the kernels' equality with it on and off is
tests/engine/test_cuda_graph.py::test_pdl_steps_equal_steps_without_it, on a CUDA device)."""

from __future__ import annotations

import torch

from specchat.kernels import pdl


def test_pdl_is_off_off_cuda_and_override_restores_the_setting():
    cpu = torch.device("cpu")
    assert not pdl.enabled(cpu)
    with pdl.scope(True):  # a runner asking for it (CUDA-graph steps of an MXFP4 model)
        assert not pdl.enabled(cpu) and pdl._scoped
        with pdl.override(False):
            assert pdl._override is False  # benchmarks and tests decide over the runner
    assert not pdl._scoped
    with pdl.override(True):
        assert not pdl.enabled(cpu)  # never on the CPU (or under the interpreter), whatever is asked
        with pdl.override(False):
            assert pdl._override is False
        assert pdl._override is True
    assert pdl._override is None
    try:
        with pdl.override(True):
            raise KeyError("inside")
    except KeyError:
        pass
    assert pdl._override is None
