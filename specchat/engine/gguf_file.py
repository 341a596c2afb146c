"""A GGUF file's metadata and tensor table, read straight from a memory map.

gguf's own reader builds a numpy view per metadata item: over the default model's 49k-token vocabulary and 49k
merges that took 3.8 s of a first load (2-core Xeon), and transformers' tokenizer conversion parsed the file a
second time. This reader walks the header once with `struct` (the vocabulary in ~50 ms) and maps each tensor's
bytes as gguf's reader does: typed arrays for float and integer tensors, uint8 rows of blocks for quantized ones,
so `gguf.quants.dequantize` and our block kernels read them unchanged.

Format (little-endian, versions 2 and 3): magic "GGUF", uint32 version, uint64 tensor and metadata counts, the
metadata as (string key, uint32 type, value), then per tensor (string name, uint32 dims, uint64 dims innermost
first, uint32 ggml type, uint64 offset), then the tensor data from the next multiple of `general.alignment`.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from specchat.errors import ModelFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
Q4_1_BYTES, Q8_0_BYTES, Q4_0_BYTES = 20, 34, 18  # bytes per block of 32: fp16 d (+ fp16 m) + codes

# metadata value types: struct format of the scalars (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# tensor types whose data is a typed array of elements (the rest: uint8 rows of quantized blocks)
_ELEMENT_TYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # dimensions innermost first, as the file lists them (gguf's reader does the same)
    data: np.ndarray  # read-only view of the mapped file: elements, or uint8 rows of blocks


class GGUFFile:
    """`metadata` (key -> int, float, bool, str or a list of them) and `tensors` of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ModelFormatError(f"{path}: not a GGUF file (it is empty)") from None
        except OSError as exc:
            raise ModelFormatError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError, MemoryError, RecursionError) as exc:
            raise ModelFormatError(f"{path}: not a readable GGUF file (damaged or truncated: {exc})") from None

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def _parse(self) -> None:
        buf, where = self._map, self.path
        if buf[:4] != MAGIC:
            raise ModelFormatError(f"{where}: not a GGUF file (it does not start with 'GGUF')")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            what = "a big-endian GGUF file" if swapped in VERSIONS else f"GGUF version {version}"
            raise ModelFormatError(f"{where}: {what} is not supported (little-endian versions 2 and 3 are)")
        n_tensors, n_items = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        for _ in range(n_items):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFormatError(f"{where}: general.alignment must be a power of two, got {alignment!r}")
        start = -(-self._pos // alignment) * alignment
        whole = np.frombuffer(buf, dtype=np.uint8)
        seen: set[str] = set()
        for name, dims, gtype, offset in infos:
            if name in seen:
                raise ModelFormatError(f"{where}: tensor {name} appears twice")
            seen.add(name)
            if offset % alignment:
                raise ModelFormatError(f"{where}: tensor {name}'s data is not aligned to {alignment} bytes (damaged?)")
            self.tensors.append(self._tensor(whole, start, name, dims, gtype, offset))
        # each tensor's bytes are its own (llama.cpp's writer packs them in order): a type or a dimension altered by
        # damage reads into its neighbour's bytes, which would load as wrong weights without a word
        spans = sorted((t.data.ctypes.data, t.data.nbytes, t.name) for t in self.tensors)
        for (begin, size, name), (after, _, other) in itertools.pairwise(spans):
            if begin + size > after:
                raise ModelFormatError(f"{where}: tensors {name} and {other} overlap in the file (damaged?)")

    def _tensor(self, whole: np.ndarray, start: int, name: str, dims: tuple[int, ...], gtype: int, offset: int):
        try:
            ttype = GGMLQuantizationType(gtype)
            block, block_bytes = GGML_QUANT_SIZES[ttype]
        except (ValueError, KeyError):
            raise ModelFormatError(f"{self.path}: tensor {name} has an unknown ggml type {gtype}") from None
        shape = tuple(reversed(dims))  # outermost first, as numpy wants
        count = math.prod(dims)  # (Python's integers: numpy's int64 product wraps around on damaged dimensions)
        if not count:
            raise ModelFormatError(f"{self.path}: tensor {name} has no elements (shape {shape})")
        if ttype in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[ttype])
            nbytes = count * dtype.itemsize
        else:
            if not shape or shape[-1] % block:
                raise ModelFormatError(f"{self.path}: tensor {name}'s rows are not whole {ttype.name} blocks")
            dtype, nbytes = np.dtype(np.uint8), count // block * block_bytes
            shape = (*shape[:-1], shape[-1] // block * block_bytes)
        begin = start + offset
        if begin + nbytes > len(whole):
            raise ModelFormatError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
        data = whole[begin : begin + nbytes].view(dtype).reshape(shape)
        return GGUFTensor(name, ttype, dims, data)

    # --- the header's pieces ---
    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        begin = self._pos + 8
        self._pos = begin + n
        if self._pos > len(self._map):
            raise IndexError("a string runs past the end of the file")
        return str(self._map[begin : self._pos], "utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item in _SCALARS:  # numbers in one read
                fmt = _SCALARS[item]
                size = struct.calcsize(fmt) * count
                if self._pos + size > len(self._map):
                    raise IndexError("an array runs past the end of the file")
                values = np.frombuffer(self._map, dtype="<" + fmt, count=count, offset=self._pos)
                self._pos += size
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # strings (a vocabulary) or nested arrays
        raise ModelFormatError(f"{self.path}: metadata value of unknown type {kind}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        if n_dims > 8:
            raise ModelFormatError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = self._unpack(f"<{n_dims}Q")
        gtype, offset = self._unpack("<IQ")
        return name, tuple(int(d) for d in dims), gtype, offset


# --- blocks of 32 values: the layouts the CPU kernels read, and dequantization -----------------------------------
def q4_1_arrays(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_1 bytes of a [rows, K] tensor -> codes [rows, K/2], d, m [rows, K/32] (float32)."""
    blocks = raw.reshape(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 4:]).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def q8_0_arrays(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q8_0 bytes of a [rows, K] tensor -> codes int8 [rows, K], d [rows, K/32] (float32)."""
    blocks = raw.reshape(rows, -1, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d)


def q4_0_arrays(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_0 bytes (w = d * (q - 8)) -> the Q4_1 arrays of the same values: the same codes, m = -8 d."""
    blocks = raw.reshape(rows, -1, Q4_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 2:]).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(-8.0 * d)


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """A tensor's values in float32, as `gguf.quants.dequantize` computes them (bit for bit): Q4_1 and Q8_0, the
    default model's types, whole-tensor in torch (the default model's in 0.38 s against gguf's 1.2 s a row group at
    a time, 2-core Xeon), in place over one float32 copy of the codes; other types through gguf."""
    from specchat.kernels.cpu_gemv import BLOCK, q4_codes

    data, kind = np.asarray(tensor.data), tensor.tensor_type
    if kind in _ELEMENT_TYPES:
        return torch.from_numpy(data.astype(np.float32))
    shape = tuple(reversed(tensor.shape))
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if kind == GGMLQuantizationType.Q4_1:  # d * q + m
        codes, d, m = q4_1_arrays(data, rows)
        values = q4_codes(codes, d).float().view(rows, -1, BLOCK)
        return values.mul_(d[..., None]).add_(m[..., None]).reshape(shape)
    if kind == GGMLQuantizationType.Q8_0:  # d * q
        codes, d = q8_0_arrays(data, rows)
        return codes.float().view(rows, -1, BLOCK).mul_(d[..., None]).reshape(shape)
    from gguf.quants import dequantize as gguf_dequantize

    with np.errstate(all="ignore"):  # a damaged block's NaN scale: the loader names the tensor, numpy need not warn
        return torch.from_numpy(np.array(gguf_dequantize(data, kind), dtype=np.float32))
