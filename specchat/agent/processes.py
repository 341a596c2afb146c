"""Confined tool processes: python and shell commands with limits, a clean environment, and nothing left behind.

Every call starts specchat/agent/launcher.py in a new session (in new namespaces and its own pids cgroup where
the machine allows, specchat/agent/isolation.py); the launcher starts the command with RLIMIT_NPROC,
RLIMIT_AS, RLIMIT_CPU and RLIMIT_FSIZE and reports its exit status on a pipe. When the command exits or the
timeout passes, everything the call started is killed, found by the strongest mechanism there is:

- PID namespace: the launcher is PID 1; killing it makes the kernel kill every process in the namespace.
- pids cgroup: every process of the call is a member, `setsid` or not; members are killed until none is left.
- otherwise, /proc: the launcher is a child subreaper, so orphans stay its descendants; specchat also scans
  /proc every TRACK_INTERVAL_S while the command runs and records every descendant (PID and start time), so
  one that outlives a killed launcher is still found. A process born and detached (launcher killed) between
  two scans escapes this; so may one that another user's process started for it.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from specchat.agent.isolation import CallCgroup, Isolation, detect_isolation
from specchat.agent.sandbox import SandboxError, truncation_marker
from specchat.errors import ConfigError

MIB = 1024 * 1024
MIN_MEMORY_MB = 64  # below this the interpreter itself cannot start
READ_CHUNK = 65536
READER_GRACE_S = 1.0  # how long to wait for the pipe to drain after every process is gone
TRACK_INTERVAL_S = 0.2  # /proc scan period while a command runs, when neither namespaces nor a cgroup track it
CANCEL_POLL_S = 0.1  # how often a wait looks at its cancel event (Ctrl-C ends a run within this)
SWEEP_ROUNDS = 100
NPROC_PER_NAMESPACE = (5, 14)  # kernels from 5.14 count RLIMIT_NPROC per user namespace


MAX_TASKS = 4_194_304  # Linux's largest pid_max


@dataclass(slots=True)
class ProcessLimits:
    """What one python or shell call may use; memory, CPU and file size are per process.

    The defaults leave room for ordinary work: numpy starts a thread per core (256 tasks covers 200-core
    machines), and `import torch` of a CUDA build maps 3.7 GiB of address space (initialising CUDA maps ~17 GiB,
    so a tool that uses the GPU needs a larger memory_mb).
    """

    max_processes: int = 256  # tasks (processes and threads) alive at once, the command's first one included
    memory_mb: int = 8192  # address space of each process (RLIMIT_AS): allocations beyond it fail
    cpu_s: int = 60  # CPU seconds of each process (RLIMIT_CPU): SIGXCPU then, SIGKILL a second later
    file_mb: int = 64  # largest file a process may write (RLIMIT_FSIZE): writes beyond it fail

    def __post_init__(self) -> None:
        for name in ("max_processes", "memory_mb", "cpu_s", "file_mb"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
            # the most setrlimit and a cgroup take (Linux's largest pid_max; 2^31 - 1 MiB or s): beyond, every call
            # failed with the launcher's OverflowError or ERANGE instead of the script failing at load
            most = MAX_TASKS if name == "max_processes" else 2**31 - 1
            if value > most:
                raise ConfigError(f"{name} must be at most {most:,}, got {value:,}")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ConfigError(f"memory_mb must be >= {MIN_MEMORY_MB}, got {self.memory_mb}")

    def rlimits(self, isolation: Isolation) -> dict[str, list[int]]:
        """The launcher's [soft, hard] pairs. RLIMIT_NPROC counts every task of the user: in a user namespace
        (Linux 5.14+) only those inside it (the command's, `unshare`'s and the launcher's), elsewhere all of
        them, so the user's current count is added."""
        if isolation.namespaces and _kernel_version() >= NPROC_PER_NAMESPACE:
            nproc = self.max_processes + 2
        else:
            nproc = user_task_count() + self.max_processes
        return {
            "nproc": [nproc, nproc],
            "as": [self.memory_mb * MIB, self.memory_mb * MIB],
            "cpu": [self.cpu_s, self.cpu_s + 1],
            "fsize": [self.file_mb * MIB, self.file_mb * MIB],
        }


@dataclass(slots=True)
class ProcessResult:
    """What a confined command left behind: its exit status and its capped, interleaved stdout + stderr."""

    returncode: int | None  # None when it was killed at the timeout or cancelled; -N: killed by signal N
    output: str
    timed_out: bool
    truncated: bool
    cancelled: bool = False  # killed because the run was cancelled (Ctrl-C), not by its timeout


@dataclass(frozen=True, slots=True)
class ProcessEntry:
    """One line of /proc/PID/stat, the fields the sweep needs."""

    pid: int
    ppid: int
    state: str  # "Z": a zombie, already dead
    start_time: int  # clock ticks after boot; tells a process from a later one with its PID


def confined_env(workspace: Path) -> dict[str, str]:
    """A minimal environment: PATH and a UTF-8 locale, HOME in the workspace, no proxies or credentials."""
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(workspace),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }


def run_python(
    code: str,
    workspace: Path,
    timeout_s: float,
    output_cap: int,
    limits: ProcessLimits | None = None,
    isolation: Isolation | None = None,
    cancelled: threading.Event | None = None,
) -> ProcessResult:
    """Run `code` with `python -I` behind the prelude's guards (specchat/agent/prelude.py), in the workspace."""
    argv = [sys.executable, "-I", "-X", "utf8", "-c", _source("prelude.py")]
    return run_confined(argv, workspace, timeout_s, output_cap, limits, isolation, stdin_text=code, cancelled=cancelled)


def run_confined(
    argv: list[str],
    workspace: Path,
    timeout_s: float,
    output_cap: int,
    limits: ProcessLimits | None = None,
    isolation: Isolation | None = None,
    stdin_text: str | None = None,
    cancelled: threading.Event | None = None,
) -> ProcessResult:
    """Run `argv` in the workspace under the launcher; every process it starts is killed when it returns, at
    its timeout, or once `cancelled` is set.

    Output beyond `output_cap` bytes is dropped from the middle as it is read, so memory stays bounded.
    """
    env = confined_env(workspace)
    program = shutil.which(argv[0], path=env["PATH"])
    if program is None:
        raise SandboxError(f"command not found: {argv[0]!r}")
    call = _ConfinedCall(limits or ProcessLimits(), isolation or detect_isolation())
    try:
        call.start([program, *argv[1:]], workspace, env, output_cap, stdin_text)
        status = call.wait(timeout_s, cancelled)
    finally:
        output, truncated = call.end()
    if call.timed_out or call.cancelled:
        returncode = None
    elif status is None:  # the launcher died without a report: its own status stands in
        returncode = call.process.returncode
    else:
        returncode = os.waitstatus_to_exitcode(status)
    return ProcessResult(returncode, output, call.timed_out, truncated, call.cancelled)


class _ConfinedCall:
    """One launcher and everything below it, from start to the final kill."""

    def __init__(self, limits: ProcessLimits, isolation: Isolation) -> None:
        self.limits = limits
        self.isolation = isolation
        self.cgroup: CallCgroup | None = None
        self.process: subprocess.Popen | None = None
        self.reader: _CappedReader | None = None
        self.status_fd = -1
        self.timed_out = False
        self.cancelled = False
        self.recorded: dict[int, int] = {}  # PID -> start time of every descendant seen (the /proc fallback)

    @property
    def scans_proc(self) -> bool:
        return not self.isolation.namespaces and self.cgroup is None

    def start(
        self, argv: list[str], workspace: Path, env: dict[str, str], output_cap: int, stdin_text: str | None
    ) -> None:
        if self.isolation.pids_cgroup is not None:
            try:  # + 1: the launcher is a member too
                self.cgroup = CallCgroup.create(self.isolation.pids_cgroup, self.limits.max_processes + 1)
            except OSError as error:
                raise SandboxError(f"cannot make the call's cgroup: {error}") from None
        self.status_fd, status_w = os.pipe()
        output_r, output_w = os.pipe()
        config = {
            "status_fd": status_w,
            "output_fd": output_w,
            "cgroup_procs": str(self.cgroup.procs) if self.cgroup is not None else None,
            "limits": self.limits.rlimits(self.isolation),
        }
        launcher = [sys.executable, "-I", "-c", _source("launcher.py"), json.dumps(config), *argv]
        try:
            self.process = subprocess.Popen(
                [*self.isolation.unshare_argv(), *launcher],
                cwd=workspace,
                env=env,
                stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # `unshare` reports the launcher's kill here; the command writes
                stderr=subprocess.DEVNULL,  # to output_fd
                start_new_session=True,
                pass_fds=(status_w, output_w),
            )
        except OSError as error:
            os.close(output_r)
            raise SandboxError(f"cannot start {argv[0]!r}: {error.strerror}") from None
        finally:
            os.close(status_w)
            os.close(output_w)
        self.reader = _CappedReader(os.fdopen(output_r, "rb"), output_cap)
        self.reader.start()
        if stdin_text is not None:  # on a thread: a command that never reads must not block us
            threading.Thread(target=_feed, args=(self.process, stdin_text), daemon=True).start()

    def wait(self, timeout_s: float, cancelled: threading.Event | None = None) -> int | None:
        """The command's wait status; None at the timeout (timed_out is set), once `cancelled` is set (so is
        self.cancelled) or when the launcher ended without reporting one."""
        deadline = time.monotonic() + timeout_s
        report = b""
        while (remaining := deadline - time.monotonic()) > 0:
            if cancelled is not None and cancelled.is_set():
                self.cancelled = True
                return None
            period = min(remaining, TRACK_INTERVAL_S) if self.scans_proc else remaining
            period = period if cancelled is None else min(period, CANCEL_POLL_S)
            ready, _, _ = select.select([self.status_fd], [], [], period)
            if self.scans_proc:
                self._record_descendants()
            if ready:
                chunk = os.read(self.status_fd, 64)
                if not chunk:
                    return None
                report += chunk
                if report.endswith(b"\n"):
                    return int(report)
        self.timed_out = True
        return None

    def end(self) -> tuple[str, bool]:
        """Kill everything the call started, remove its cgroup; its output and whether it was truncated."""
        if self.process is not None:
            if self.isolation.namespaces:
                for entry in _children(self.process.pid, process_table()):  # the namespace's PID 1
                    _kill(entry.pid)
            elif self.cgroup is None:
                self._sweep()
            if self.cgroup is not None:
                self.cgroup.kill_all()
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.status_fd >= 0:
            os.close(self.status_fd)
        if self.reader is None:
            return "", False
        self.reader.join(READER_GRACE_S)
        return self.reader.text(), self.reader.dropped > 0

    def _record_descendants(self) -> None:
        table = process_table()
        for entry in descendants({self.process.pid}, table):
            self.recorded.setdefault(entry.pid, entry.start_time)

    def _sweep(self) -> None:
        """Kill the launcher's descendants and every recorded process still alive, and theirs, until none is
        left; the launcher goes last, so orphans of killed processes are reparented to it, not lost."""
        launcher = self.process.pid
        for _ in range(SWEEP_ROUNDS):
            table = process_table()
            recorded = {pid for pid, start in self.recorded.items() if pid in table and table[pid].start_time == start}
            alive = [e.pid for e in descendants({launcher, *recorded}, table) if e.state != "Z"]
            alive += [pid for pid in recorded if table[pid].state != "Z"]
            alive = [pid for pid in dict.fromkeys(alive) if pid != launcher]
            if not alive:
                return
            for pid in alive:
                _kill(pid)
            time.sleep(0.01)


def process_table() -> dict[int, ProcessEntry]:
    """Every process visible in /proc now."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                line = stat.read().decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        fields = line[line.rindex(")") + 2 :].split()  # after "PID (comm) ", comm may hold spaces
        table[int(name)] = ProcessEntry(int(name), int(fields[1]), fields[0], int(fields[19]))
    return table


def descendants(roots: set[int], table: dict[int, ProcessEntry]) -> list[ProcessEntry]:
    """Every process below `roots` in `table` (the roots themselves excluded)."""
    found, frontier = [], list(roots)
    while frontier:
        children = [entry for pid in frontier for entry in _children(pid, table)]
        found += children
        frontier = [entry.pid for entry in children if entry.pid not in roots]
    return found


def user_task_count() -> int:
    """Tasks (processes and threads) of this real user now: what the kernel checks RLIMIT_NPROC against."""
    uid, count = str(os.getuid()), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with suppress(OSError):
            status = dict(line.split(":\t", 1) for line in Path(f"/proc/{name}/status").read_text().splitlines())
            if status["Uid"].split()[0] == uid:
                count += int(status["Threads"])
    return count


def _children(pid: int, table: dict[int, ProcessEntry]) -> list[ProcessEntry]:
    return [entry for entry in table.values() if entry.ppid == pid]


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _kernel_version() -> tuple[int, int]:
    release = os.uname().release.split("-")[0].split(".")
    try:
        return int(release[0]), int(release[1])
    except (IndexError, ValueError):
        return 0, 0


@functools.cache
def _source(name: str) -> str:
    """The text of a standalone script beside this module (launcher.py, prelude.py), run with `python -c`."""
    return Path(__file__).with_name(name).read_text(encoding="utf-8")


def _feed(process: subprocess.Popen, text: str) -> None:
    """Write the program text to the command's stdin and close it; a command that died early is no error here."""
    with suppress(OSError):
        process.stdin.write(text.encode())
        process.stdin.close()


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
