"""Reading safetensors files with errors a user can act on: the engine's HF loader and quant's MXFP4 checkpoints.

A damaged weight file (a truncated download, a copy cut short) should end in one line naming the file
(docs/style.md #12), not in safetensors' own message. The format: an 8-byte little-endian header length, a JSON
header mapping each tensor name to its dtype, shape and byte range (`data_offsets`, relative to the end of the
header), then the data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from specchat.errors import ModelFormatError

HEADER_LEN_BYTES = 8  # the little-endian uint64 that opens every safetensors file


def check_safetensors_size(file: Path) -> None:
    """A clear ModelFormatError for a truncated file or a corrupt header, before safetensors' own error."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(HEADER_LEN_BYTES)
        if len(head) < HEADER_LEN_BYTES:
            raise ModelFormatError(f"{file}: truncated safetensors file ({size} bytes)")
        header_len = struct.unpack("<Q", head)[0]
        if HEADER_LEN_BYTES + header_len > size:
            raise ModelFormatError(f"{file}: truncated safetensors file (header needs {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFormatError(f"{file}: corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if HEADER_LEN_BYTES + header_len + end > size:
        needed = HEADER_LEN_BYTES + header_len + end
        raise ModelFormatError(f"{file}: truncated safetensors file ({size} bytes, needs {needed})")


def read_safetensors(file: Path, keep: Callable[[str], bool] = lambda _: True) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file whose names `keep` accepts; ModelFormatError if the file is damaged."""
    from safetensors import safe_open

    check_safetensors_size(file)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if keep(name)}  # noqa: SIM118 (not iterable)
    except Exception as exc:  # safetensors raises SafetensorError and others on damaged files
        raise ModelFormatError(f"{file}: cannot read safetensors ({exc})") from None
