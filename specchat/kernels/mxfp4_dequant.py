"""MXFP4 weights dequantized into a shared scratch buffer, for one F.linear at a time.

`mxfp4_linear` (kernels/mxfp4_matmul.py) borrows the buffer for one F.linear, so the packed weight stays the only
resident copy. Two producers, both `dequantize_mxfp4`'s values (kernels/mxfp4.py, the reference):

- a plain-layout weight (the CPU's): through a byte -> (two E2M1 values) table, a chunk of rows at a time;
- a kernel-layout weight (CUDA's, kernels/mxfp4_layout.py), for steps of many rows (prefill chunks), where
  cuBLAS on the decoded weight outruns the MXFP4 matmul kernel: `dequantize_prepared_into`, a Triton kernel
  (kernels/mxfp4_dequant_triton.py, imported at its first launch) that decodes each (64-row group, k-tile)
  block as the matmul kernel does and stores it. Its values are the reference's times 2^-c (the layout's
  exponent offset, `Mxfp4Weight.exp_offset`; 0 for real weights): the caller scales the product by 2^c, as the
  matmul kernel does.
"""

from __future__ import annotations

import functools
import math

import torch

from specchat.kernels.mxfp4 import BLOCK_SIZE, e2m1_to_float, scales_to_float, unpack_nibbles
from specchat.kernels.mxfp4_layout import Mxfp4Weight


class DequantScratch:
    """One growable buffer per (device, dtype) that a dequantized weight borrows for one matmul.

    A whole model shares one instance (layers run one after another), so the resident weights stay packed and
    the extra memory is the largest single layer. The buffers are normal tensors even when made under
    torch.inference_mode (an inference tensor could not be written outside it, e.g. under torch.no_grad).
    A CUDA graph may read a buffer (a prefill graph of many rows on MXFP4 weights): it never grows during a
    capture (`holds` says whether it can serve one), and a buffer a graph captured is kept alive when a larger
    one replaces it. Not thread-safe.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._captured: set[tuple[torch.device, torch.dtype]] = set()  # buffers some graph reads
        self._retired: list[torch.Tensor] = []  # replaced buffers that a graph still reads

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        key = (device, dtype)
        buffer = self._buffers.get(key)
        capturing = _capturing(device)
        if buffer is None or buffer.numel() < numel:
            assert not capturing, "DequantScratch grows only outside a CUDA graph's capture (see `holds`)"
            if key in self._captured:
                self._retired.append(buffer)
                self._captured.discard(key)
            with torch.inference_mode(False):
                buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        if capturing:
            self._captured.add(key)
        return buffer[:numel].view(shape)

    def holds(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether `get` of this many elements is served without growing."""
        buffer = self._buffers.get((device, dtype))
        return buffer is not None and buffer.numel() >= numel

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self._buffers.values(), *self._retired))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


DEFAULT_SCRATCH = DequantScratch()


DEQUANT_CHUNK_ELEMS = 1 << 20  # rows are dequantized in chunks of about this many elements (bounded temporaries)


@functools.cache
def _byte_pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the (low, high) nibble E2M1 values of every code byte."""
    byte = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return e2m1_to_float(unpack_nibbles(byte[:, None]))


def dequantize_weight_into(weight: Mxfp4Weight, out: torch.Tensor) -> torch.Tensor:
    """Plain-layout weight -> out [N, K] (out's dtype): `dequantize_mxfp4`'s values, in row chunks."""
    assert not weight.prepared and out.shape == (weight.n, weight.k), (out.shape, weight.n, weight.k)
    table = _byte_pair_table(out.device)
    kp = weight.codes.shape[1] * 2
    rows = max(1, DEQUANT_CHUNK_ELEMS // kp)
    for r0 in range(0, weight.n, rows):
        codes = weight.codes[r0 : r0 + rows]  # [r, Kp/2]
        values = torch.index_select(table, 0, codes.flatten().to(torch.int32))  # [r * Kp/2, 2]
        values = values.view(-1, weight.scales.shape[1], BLOCK_SIZE)  # [r, Kp/32, 32]
        values *= scales_to_float(weight.scales[r0 : r0 + rows])[..., None]
        out[r0 : r0 + rows] = values.view(-1, kp)[:, : weight.k]
    return out
