"""What this machine lets specchat put around a tool process: namespaces, a pids cgroup, both or neither.

Namespaces: where an unprivileged user may create user namespaces (`unshare --user --map-root-user true`
works), every tool process runs in new user, network, PID and mount namespaces (util-linux `unshare`): no
network but a down loopback, its own /proc, and the launcher (specchat/agent/launcher.py) as PID 1, so when
the launcher is killed the kernel kills everything left in the namespace, `setsid` or not. A process in a
child user namespace cannot read /proc/PID/environ of processes outside it (ptrace access needs
CAP_SYS_PTRACE in their namespace), nor address them by PID.

pids cgroup: where specchat may create cgroups with the pids controller (cgroup v1 `pids`, or v2 with `pids`
already in the subtree of its own cgroup; in practice when it runs as root, as in many CI containers), each
call gets its own cgroup with `pids.max`, which caps processes for root too (root ignores RLIMIT_NPROC), and
whose member list finds every process of the call for the final kill.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

UNSHARE_FLAGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
PROBE_TIMEOUT_S = 5.0
CGROUP_KILL_ROUNDS = 100
CGROUP_REMOVE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Isolation:
    """The kernel mechanisms a tool process gets here; detect_isolation() says which this machine has."""

    namespaces: bool  # user, network, PID and mount namespaces through `unshare`
    pids_cgroup: Path | None = None  # the cgroup under which each call gets its own, with pids.max

    @property
    def limits_processes(self) -> bool:
        """Whether the process count is enforced: by the pids cgroup, or by RLIMIT_NPROC (root ignores it)."""
        return self.pids_cgroup is not None or os.geteuid() != 0

    def unshare_argv(self) -> list[str]:
        """The command prefix that runs a program in new namespaces, or [] without them."""
        return [shutil.which("unshare") or "unshare", *UNSHARE_FLAGS] if self.namespaces else []

    def describe(self) -> str:
        """One line for the trace header: what confines python and shell here, and what does not."""
        cgroup = ", a pids cgroup" if self.pids_cgroup is not None else ""
        count = "" if self.limits_processes else "; the process count is not limited (root without a pids cgroup)"
        if self.namespaces:
            return f"user, network and PID namespaces{cgroup}, rlimits{count}"
        tracking = "a pids cgroup" if self.pids_cgroup is not None else "a /proc scan"
        return (
            f"no user namespaces here: rlimits and {tracking} only, the network and your other processes are "
            f"reachable; the python tool is refused unless [tools.python] allow_unsandboxed = true{count}"
        )


@functools.cache
def detect_isolation() -> Isolation:
    """The isolation this machine allows (probed once per process)."""
    return Isolation(namespaces=namespaces_available(), pids_cgroup=find_pids_cgroup())


def namespaces_available() -> bool:
    """Whether `unshare` with every flag the sandbox uses works for this user."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return False
    try:
        probe = subprocess.run([unshare, *UNSHARE_FLAGS, "true"], capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def find_pids_cgroup() -> Path | None:
    """This process's cgroup in a pids hierarchy, if a child cgroup with pids.max can be made in it."""
    candidate = _own_pids_cgroup()
    if candidate is None:
        return None
    try:
        probe = CallCgroup.create(candidate, 8)
    except OSError:
        return None
    probe.remove()
    return candidate


def _own_pids_cgroup() -> Path | None:
    """The directory of this process's cgroup that has the pids controller (v1), or delegates it (v2)."""
    try:
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in memberships:
        hierarchy, controllers, path = line.split(":", 2)
        v1 = "pids" in controllers.split(",")
        if not v1 and not (hierarchy == "0" and controllers == ""):
            continue
        for mount in mounts:
            fields, _, tail = mount.partition(" - ")
            root, mount_point = fields.split()[3:5]
            fstype, _, options = tail.split()[:3]
            if (v1 and fstype == "cgroup" and "pids" in options.split(",")) or (not v1 and fstype == "cgroup2"):
                if not Path(path).is_relative_to(root):
                    continue
                directory = Path(mount_point) / Path(path).relative_to(root)
                if v1 or "pids" in _read(directory / "cgroup.subtree_control").split():
                    return directory
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class CallCgroup:
    """The pids cgroup of one tool call: made before the call, emptied and removed after it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, parent: Path, max_pids: int) -> CallCgroup:
        """A new cgroup under `parent` that holds at most `max_pids` tasks."""
        path = parent / f"specchat-{os.getpid()}-{secrets.token_hex(4)}"
        path.mkdir()
        cgroup = cls(path)
        try:
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            cgroup.remove()
            raise
        return cgroup

    @property
    def procs(self) -> Path:
        """The file a process writes "0" to, to join."""
        return self.path / "cgroup.procs"

    def members(self) -> list[int]:
        """The PIDs in the cgroup now."""
        return [int(pid) for pid in _read(self.procs).split()]

    def kill_all(self) -> None:
        """SIGKILL every member until none is left (new members can only come from old ones)."""
        kill_file = self.path / "cgroup.kill"  # cgroup v2, Linux 5.14+: one atomic kill
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        for _ in range(CGROUP_KILL_ROUNDS):
            members = self.members()
            if not members:
                return
            for pid in members:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        """Remove the cgroup once its killed members are gone (it stays, empty, if they take too long)."""
        deadline = time.monotonic() + CGROUP_REMOVE_WAIT_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
