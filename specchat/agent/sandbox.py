"""What agent tools may touch: workspace paths, and subprocesses with a timeout, an output cap and no network.

File tools read or write only regular files with one link inside the workspace: a hard link can name a file
outside it (the link count is all a process can see of that), and opening a FIFO, socket or device can block
forever or never end. Files are opened non-blocking and without following a symlink, and checked again after
opening.

"No network" has two layers. Every Python tool process starts behind a prelude that replaces socket creation
and name lookup with a PermissionError; that stops ordinary Python code (urllib, requests, asyncio, ssl), but
not a child process it spawns or code that reaches the OS through ctypes. Where the kernel lets an
unprivileged user create namespaces (`unshare --user --net` works), every tool process also runs in a fresh
network namespace with only a down loopback, which stops everything, children included. Neither is a
security boundary against hostile code: the process keeps the user's file permissions outside the workspace.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_FILE_BYTES = 64 * 1024 * 1024  # largest file a python tool process may write (RLIMIT_FSIZE)
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
READ_CHUNK = 65536
READER_GRACE_S = 1.0  # how long to wait for the pipe to drain after the process group is gone

PYTHON_PRELUDE = f"""
import ast, linecache, os, resource, socket, sys, traceback, _socket
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the specchat python tool")
class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()
socket.socket = socket.SocketType = _socket.socket = _NoSocket
for _name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
    setattr(socket, _name, _no_network)
_socket.getaddrinfo = _socket.gethostbyname = _no_network
resource.setrlimit(resource.RLIMIT_FSIZE, ({MAX_FILE_BYTES}, {MAX_FILE_BYTES}))
sys.path.insert(0, os.getcwd())
_source = sys.stdin.read()
sys.stdin = open(os.devnull)
linecache.cache["<agent>"] = (len(_source), None, _source.splitlines(True), "<agent>")
_globals = {{"__name__": "__main__"}}
try:
    _tree = ast.parse(_source, "<agent>")
    _last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
    exec(compile(_tree, "<agent>", "exec"), _globals)
    if _last is not None:
        _value = eval(compile(ast.Expression(_last.value), "<agent>", "eval"), _globals)
        if _value is not None:
            print(repr(_value))
except SystemExit:
    raise
except BaseException as _error:
    _frames = None if isinstance(_error, SyntaxError) else _error.__traceback__.tb_next
    traceback.print_exception(type(_error), _error, _frames)
    sys.exit(1)
"""


class SandboxError(Exception):
    """A request the sandbox refuses; the message is written for the model."""


@dataclass(slots=True)
class ProcessResult:
    """What a confined subprocess left behind: its exit status and its capped, interleaved stdout + stderr."""

    returncode: int | None  # None when it was killed at the timeout
    output: str
    timed_out: bool
    truncated: bool


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


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare --user --map-root-user --net` works here (unprivileged user namespaces allowed)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return False
    probe = [unshare, "--user", "--map-root-user", "--net", "true"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=5, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def confined_env(workspace: Path) -> dict[str, str]:
    """A minimal environment: PATH and a UTF-8 locale, HOME in the workspace, no proxies or credentials."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(workspace),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }


def run_python(code: str, workspace: Path, timeout_s: float, output_cap: int) -> ProcessResult:
    """Run `code` with `python -I` behind the no-network prelude, in the workspace."""
    argv = [sys.executable, "-I", "-X", "utf8", "-c", PYTHON_PRELUDE]
    return run_confined(argv, workspace, timeout_s, output_cap, stdin_text=code)


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


def run_confined(
    argv: list[str], workspace: Path, timeout_s: float, output_cap: int, stdin_text: str | None = None
) -> ProcessResult:
    """Run `argv` in the workspace in its own process group (and network namespace where possible).

    The whole group is killed at the timeout and when the command exits, so background children do not
    outlive the call. Output beyond `output_cap` bytes is dropped from the middle as it is read, so memory
    stays bounded.
    """
    env = confined_env(workspace)
    program = shutil.which(argv[0], path=env["PATH"])
    if program is None:
        raise SandboxError(f"command not found: {argv[0]!r}")
    argv = [program, *argv[1:]]
    if network_namespace_available():
        argv = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--net", *argv]
    try:
        process = subprocess.Popen(
            argv,
            cwd=workspace,
            env=env,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as error:
        raise SandboxError(f"cannot start {argv[0]!r}: {error.strerror}") from None
    reader = _CappedReader(process.stdout, output_cap)
    reader.start()
    if stdin_text is not None:
        _feed(process, stdin_text)
    timed_out = False
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    _kill_group(process)
    process.wait()
    reader.join(READER_GRACE_S)  # a grandchild that left the group with setsid may still hold the pipe
    return ProcessResult(
        returncode=None if timed_out else process.returncode,
        output=reader.text(),
        timed_out=timed_out,
        truncated=reader.dropped > 0,
    )


def _feed(process: subprocess.Popen, text: str) -> None:
    """Write the program text to the child's stdin and close it; a child that died early is no error here."""
    with suppress(OSError):
        process.stdin.write(text.encode())
        process.stdin.close()


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group the command leads."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class _CappedReader(threading.Thread):
    """Drains a pipe, keeping the first 3/4 of the cap and a rolling last 1/4; counts what it dropped."""

    def __init__(self, stream: BinaryIO, cap: int) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.tail_size = cap // 4
        self.head_size = cap - self.tail_size
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(READ_CHUNK):
                room = self.head_size - len(self.head)
                self.head += chunk[:room]
                self.tail += chunk[room:]
                excess = len(self.tail) - self.tail_size
                if excess > 0:
                    del self.tail[:excess]
                    self.dropped += excess

    def text(self) -> str:
        """The kept output, decoded, with a marker where bytes were dropped."""
        if not self.dropped:
            return (self.head + self.tail).decode(errors="replace")
        head = self.head.decode(errors="replace")
        tail = self.tail.decode(errors="replace")
        return head + truncation_marker(self.dropped, "bytes") + tail
