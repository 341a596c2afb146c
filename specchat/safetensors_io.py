"""Reading safetensors files, and the JSON files beside them, with errors a user can act on: the engine's HF
loader and quant's MXFP4 checkpoints; and writing them (`save_tensors`) with the modes other files get.

A damaged weight file (a truncated download, a copy cut short, a header that is not what the format says) should
end in one line naming the file (docs/style.md #12), not in safetensors' own message or a KeyError. The format:
an 8-byte little-endian header length, a JSON object mapping each tensor name to its dtype, shape and byte range
(`data_offsets`, relative to the end of the header; "__metadata__" maps strings to strings), then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specchat.errors import ModelFormatError

if TYPE_CHECKING:
    import torch

HEADER_LEN_BYTES = 8  # the little-endian uint64 that opens every safetensors file


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, then the file's mode as the umask gives any new file (0644 under umask 022):
    save_file creates it 0600, so a quantized checkpoint or a heads file in a shared folder was readable by its
    owner alone."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


def process_umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it back (os.umask's only way) would,
    for that moment, give files that other threads create (the TUI's store, the engine's) the wrong mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)  # elsewhere: the brief window it is a common default
    os.umask(umask)
    return umask


def read_json_object(file: Path) -> dict:
    """A JSON object from a model's side file (config.json, an index, a tokenizer config); ModelFormatError naming
    the file if it cannot be read, is not UTF-8 or JSON, or holds something other than an object."""
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ModelFormatError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{file}: not valid UTF-8 (at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _is_offsets(value: object) -> bool:
    """A [begin, end] byte range of non-negative integers."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        and value[0] <= value[1]
    )


def tensor_data_end(header: object, file: Path) -> int:
    """Where the last tensor's data ends (bytes after the header), checking the header's structure on the way."""
    if not isinstance(header, dict):
        raise ModelFormatError(f"{file}: corrupt safetensors header (a {type(header).__name__}, not an object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not _is_offsets(entry.get("data_offsets")):
            raise ModelFormatError(f"{file}: corrupt safetensors header (tensor {name!r} has no valid data_offsets)")
        end = max(end, entry["data_offsets"][1])
    return end


def check_safetensors_size(file: Path) -> None:
    """A clear ModelFormatError for a file we may not read, a truncated file or a corrupt header, before
    safetensors' own error."""
    try:
        _check_safetensors_size(file)
    except OSError as exc:  # not ours to read (a PermissionError traceback), a folder, gone meanwhile
        raise ModelFormatError(f"{file}: cannot read ({exc.strerror or exc})") from None


def _check_safetensors_size(file: Path) -> None:
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
    end = tensor_data_end(header, file)
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
