"""Files and folders written whole, and folders checked for writing before long work: what train-heads and
quantize share.

A result (heads, an EAGLE-3 head's folder, an MXFP4 checkpoint, a training run's work files) is written under a
temporary name beside its place and renamed into it, so a run stopped or failing mid-write (Ctrl-C, a full disk)
leaves the earlier result, or nothing, never a torn one; a write that fails is one ConfigError naming the path.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError

from specchat.errors import ConfigError

# What a serializer raises when its file cannot be written (a full or read-only disk): OSError, safetensors' own
# error, and torch.save's zip writer, whose short write is a RuntimeError (`write_failed` tells it from others).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failed(exc: BaseException) -> bool:
    """Whether a WRITE_ERRORS exception says the disk refused the bytes: a RuntimeError only where torch.save's zip
    writer says so ("unexpected pos", "failed writing"); any other RuntimeError is a bug of ours and keeps its
    traceback."""
    if isinstance(exc, (OSError, SafetensorError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("unexpected pos" in text or "failed writing" in text)


def write_error(path: Path, exc: BaseException) -> ConfigError:
    """One line for a file or folder that could not be written."""
    if isinstance(exc, OSError) and exc.strerror:
        why = exc.strerror
    elif isinstance(exc, SafetensorError):  # (its text for a full disk: "Error while serializing: ... too large")
        why = str(exc).removeprefix("Error while ")
    else:
        why = "the write failed: is the disk full?"
    return ConfigError(f"{path}: cannot write it ({why})")


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """Write a file by `write(partial path)` beside `path`, then rename it into place."""
    part = path.with_name(path.name + ".part")
    try:
        write(part)
        os.replace(part, path)
    except WRITE_ERRORS as exc:
        if not write_failed(exc):
            raise
        raise write_error(path, exc) from None
    finally:
        part.unlink(missing_ok=True)


def write_folder_whole(out: Path, save: Callable[[Path], None]) -> None:
    """Write a folder by `save(partial folder)` beside `out`, then put it in `out`'s place (an earlier one there is
    replaced whole)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    try:
        shutil.rmtree(part, ignore_errors=True)
        save(part)
        shutil.rmtree(out, ignore_errors=True)
        part.rename(out)
    except WRITE_ERRORS as exc:
        if not write_failed(exc):
            raise
        raise write_error(out, exc) from None
    finally:
        shutil.rmtree(part, ignore_errors=True)


def check_writable_folder(folder: Path, what: str) -> None:
    """Make `folder` if it is missing and check that a file can be made in it, before minutes of work that end
    writing there: a ConfigError naming `what` (the flag) otherwise. os.access alone says yes where nothing can be
    made (/proc, /sys as root), so a file is made and removed too."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot make {folder} ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{what}: cannot write in {folder}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".specchat.", dir=folder))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot write in {folder} ({exc.strerror or exc})") from None
