"""The first process of every confined tool call: it sets the limits, starts the command and reports how it ended.

Run as `python -I -c <this file's text> CONFIG_JSON PROGRAM ARG...` (specchat/agent/processes.py), standalone
(standard library only, never imported). It joins the call's pids cgroup when there is one, makes itself the
reaper of every orphan below it (PR_SET_CHILD_SUBREAPER, or by being PID 1 of a new PID namespace), forks the
command with RLIMIT_NPROC, RLIMIT_AS, RLIMIT_CPU and RLIMIT_FSIZE set, and writes the command's raw wait status
as one line to the status fd. Everything it and the command print goes to the output fd. Then it stays, reaping, so that everything the command left behind stays its
descendant until specchat has killed it all; specchat kills the launcher last. Should specchat itself be ended
mid-call, the launcher sees the status pipe lose its reader and kills what it can reach (end_with_specchat).
"""

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
EXEC_FAILED = 127
SETUP_FAILED = 126
LIMITS = {
    "nproc": resource.RLIMIT_NPROC,
    "as": resource.RLIMIT_AS,
    "cpu": resource.RLIMIT_CPU,
    "fsize": resource.RLIMIT_FSIZE,
}


def start_command(argv: list[str], limits: dict[str, list[int]]) -> int:
    """Fork the command with its limits; in the child, exec it (or exit 127 with a line on stderr)."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for ignored_by_python in (signal.SIGPIPE, signal.SIGXFSZ):  # as subprocess's restore_signals does
            signal.signal(ignored_by_python, signal.SIG_DFL)
        for name, (soft, hard) in limits.items():
            resource.setrlimit(LIMITS[name], (soft, hard))
        os.execv(argv[0], argv)
    except OSError as error:
        os.write(2, f"cannot run {argv[0]}: {error.strerror}\n".encode())
    os._exit(EXEC_FAILED)


def end_with_specchat(status_fd: int, cgroup_procs: str | None) -> None:
    """Once specchat is gone (ended by SIGTERM or SIGKILL mid-call: the status pipe has no reader left), kill the
    command and what it started, and this launcher, which otherwise reaped forever waiting for specchat's kill."""
    poller = select.poll()
    poller.register(status_fd, select.POLLERR)
    poller.poll()  # POLLERR on a pipe's write end: its last reader has closed it
    if cgroup_procs:  # every member, setsid ones too (cgroup v2, Linux 5.14+)
        with (
            contextlib.suppress(OSError),
            open(os.path.join(os.path.dirname(cgroup_procs), "cgroup.kill"), "w") as kill,
        ):
            kill.write("1")
    with contextlib.suppress(OSError):
        os.killpg(0, signal.SIGKILL)  # the command and what it started in the launcher's process group
    os._exit(1)  # as PID 1 of a PID namespace, which ignores the kill above: its end kills every process in it


def main() -> None:
    config, argv = json.loads(sys.argv[1]), sys.argv[2:]
    status_fd = config["status_fd"]
    os.set_inheritable(status_fd, False)
    for stream in (1, 2):  # the command's stdout and stderr, and our own messages, go to the output pipe
        os.dup2(config["output_fd"], stream)
    os.close(config["output_fd"])
    try:
        if config["cgroup_procs"]:
            with open(config["cgroup_procs"], "w") as procs:
                procs.write("0")  # this process; the command and all it starts inherit the cgroup
        if os.getpid() != 1:  # PID 1 of a namespace reaps orphans already
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    except OSError as error:
        os.write(2, f"specchat sandbox: cannot confine the command: {error}\n".encode())
        sys.exit(SETUP_FAILED)
    command = start_command(argv, config["limits"])
    # after the fork: a process that forks while it has threads may deadlock (Python 3.12 warns of it)
    threading.Thread(target=end_with_specchat, args=(status_fd, config["cgroup_procs"]), daemon=True).start()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the command has the program text; a writer must not wait on us
    while True:
        pid, status = os.wait()
        if pid == command:
            break
    os.write(status_fd, f"{status}\n".encode())
    while True:  # reap what the command left until specchat has killed it and us
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
