"""What agent tools may touch: workspace paths and the command lines the shell tool may run.

File tools read or write only regular files with one link inside the workspace: a hard link can name a file
outside it (the link count is all a process can see of that), and opening a FIFO, socket or device can block
forever or never end. Files are opened non-blocking and without following a symlink, and checked again after
opening. Shell commands are split without a shell and checked against the script's allowlist. The python and
shell tools' processes (limits, no network, killing what they leave behind) are agent/processes.py's.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_READ_BYTES = 8 * 1024 * 1024
MAX_WRITE_CHARS = 1_000_000
SHELL_OPERATORS = frozenset({"|", "||", "&", "&&", ";", ">", ">>", "<", "<<", "2>", "2>&1", "&>"})
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SPECIAL_KINDS = (
    (stat.S_ISFIFO, "named pipe (FIFO)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


class SandboxError(Exception):
    """A request the sandbox refuses; the message is written for the model."""


class Workspace:
    """A directory the file tools cannot leave: paths are resolved, symlinks included, and must stay in."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve(strict=True)

    def resolve(self, path: str) -> Path:
        """The real path of `path` (relative to the root, or absolute inside it); refuses anything outside."""
        if not path or "\x00" in path:
            raise SandboxError("path must be a non-empty string")
        candidate = Path(path)
        if candidate.is_absolute() and not Path(os.path.normpath(candidate)).is_relative_to(self.root):
            raise SandboxError(f"absolute path {path!r} is outside the workspace; use a relative path")
        joined = self.root / candidate
        if not Path(os.path.normpath(joined)).is_relative_to(self.root):
            raise SandboxError(f"path {path!r} uses '..' to leave the workspace")
        real = Path(os.path.realpath(joined))
        if not real.is_relative_to(self.root):
            raise SandboxError(f"path {path!r} goes through a symlink that leads outside the workspace")
        return real

    def relative(self, path: Path) -> str:
        """`path` as the model should see it: relative to the workspace root."""
        return path.relative_to(self.root).as_posix() or "."

    def read_text(self, path: str) -> str:
        """The text of a workspace file; refuses folders, special and linked files, binary files and files over
        MAX_READ_BYTES."""
        target = self.resolve(path)
        info = _stat(target)
        if info is None:
            raise SandboxError(f"no such file {path!r}")
        if stat.S_ISDIR(info.st_mode):
            raise SandboxError(f"{path!r} is a directory; use list_dir")
        check_plain_file(path, info)
        if info.st_size > MAX_READ_BYTES:
            raise SandboxError(f"{path!r} has {info.st_size} bytes; files over {MAX_READ_BYTES} bytes are not read")
        with _open_plain(path, target, os.O_RDONLY, info) as file:
            data = file.read(MAX_READ_BYTES + 1)
        if len(data) > MAX_READ_BYTES:
            raise SandboxError(f"{path!r} has over {MAX_READ_BYTES} bytes; it is not read")
        if b"\x00" in data[:8192]:
            raise SandboxError(f"{path!r} is not a text file")
        return data.decode(errors="replace")

    def write_text(self, path: str, content: str) -> str:
        """Write a workspace file, creating parent folders; returns its path relative to the root. Refuses
        folders, special and linked files."""
        if len(content) > MAX_WRITE_CHARS:
            raise SandboxError(f"content has {len(content)} characters; at most {MAX_WRITE_CHARS} are written")
        target = self.resolve(path)
        info = _stat(target)
        if info is not None and stat.S_ISDIR(info.st_mode):
            raise SandboxError(f"{path!r} is a directory")
        if info is not None:
            check_plain_file(path, info)
        target.parent.mkdir(parents=True, exist_ok=True)
        with _open_plain(path, target, os.O_WRONLY | os.O_CREAT, info) as file:
            file.truncate(0)  # only now: truncating on open would empty a linked file before the check
            file.write(content.encode("utf-8"))
        return self.relative(target)

    def list_dir(self, path: str) -> list[str]:
        """The names in a workspace folder, sorted, folders marked with a trailing '/'."""
        target = self.resolve(path)
        if not target.is_dir():
            raise SandboxError(f"{path!r} is not a directory")
        return [entry.name + ("/" if entry.is_dir() else "") for entry in sorted(target.iterdir())]


def check_plain_file(path: str, info: os.stat_result) -> None:
    """Refuse a FIFO, socket or device, and a regular file with more than one hard link."""
    for is_kind, kind in SPECIAL_KINDS:
        if is_kind(info.st_mode):
            raise SandboxError(f"{path!r} is a {kind}, not a regular file; only regular files are read or written")
    if info.st_nlink > 1:
        raise SandboxError(
            f"{path!r} has {info.st_nlink} hard links; a hard link can be a file outside the workspace, so "
            "files with more than one link are not read or written"
        )


def _stat(target: Path) -> os.stat_result | None:
    try:
        return os.stat(target)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise SandboxError(f"cannot access {target.name!r}: {error.strerror}") from None


@contextmanager
def _open_plain(path: str, target: Path, flags: int, expected: os.stat_result | None) -> Iterator:
    """`target` opened without blocking or following a symlink, checked again: still the file `expected`
    (when given) and still a plain file. A binary file object."""
    try:
        fd = os.open(target, flags | OPEN_FLAGS, 0o666)
    except OSError as error:
        raise SandboxError(f"cannot open {path!r}: {error.strerror}") from None
    with os.fdopen(fd, "rb" if flags == os.O_RDONLY else "wb") as file:
        info = os.fstat(fd)
        if expected is not None and (info.st_dev, info.st_ino) != (expected.st_dev, expected.st_ino):
            raise SandboxError(f"{path!r} was replaced while it was opened")
        check_plain_file(path, info)
        yield file


@contextmanager
def run_workspace(source: Path | None, copy: bool) -> Iterator[Path]:
    """The directory one run works in: `source` itself, a private copy of it, or a fresh empty one."""
    if source is not None and not copy:
        yield source
        return
    scratch = Path(tempfile.mkdtemp(prefix="specchat-agent-"))
    try:
        if source is not None:
            shutil.copytree(source, scratch, symlinks=True, ignore=_special_files, dirs_exist_ok=True)
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _special_files(directory: str, names: list[str]) -> list[str]:
    """The names a workspace copy skips: FIFOs, sockets and devices (copying one can block or never end)."""
    modes = {name: os.lstat(os.path.join(directory, name)).st_mode for name in names}
    return [name for name, mode in modes.items() if any(is_kind(mode) for is_kind, _ in SPECIAL_KINDS)]


def cap_text(text: str, cap: int) -> str:
    """`text` cut to about `cap` characters, keeping the head and the tail around a truncation marker."""
    if len(text) <= cap:
        return text
    tail = cap // 4
    head = cap - tail
    return text[:head] + truncation_marker(len(text) - head - tail, "characters") + text[len(text) - tail :]


def truncation_marker(omitted: int, unit: str) -> str:
    """The line that stands where output was cut."""
    return f"\n[... output truncated: {omitted} {unit} omitted ...]\n"


def shell_argv(command: str, allow: tuple[str, ...]) -> list[str]:
    """Split `command` like a shell would, without running one; refuses operators and unlisted commands."""
    try:
        argv = shlex.split(command)
    except ValueError as error:
        raise SandboxError(f"cannot split the command: {error}") from None
    if not argv:
        raise SandboxError("empty command")
    operators = sorted(SHELL_OPERATORS.intersection(argv))
    if operators:
        raise SandboxError(
            f"{' '.join(operators)} not supported: commands run without a shell (no pipes, redirection or "
            "chaining); run one command"
        )
    name = argv[0]
    if "/" in name or name not in allow:
        raise SandboxError(f"command {name!r} is not allowed; allowed: {', '.join(allow)}")
    return argv
