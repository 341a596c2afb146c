"""The sandbox refuses what it promises to refuse: path escapes, linked and special files, runaway processes,
processes that outlive their call, the network, and the parent's environment.

Process tests run under every isolation this machine has (namespaces, a pids cgroup, the /proc scan alone),
each in a fresh workspace that must hold no running process afterwards.
"""

import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specchat.agent.isolation import Isolation, detect_isolation
from specchat.agent.processes import ProcessLimits, ProcessResult, run_confined, run_python
from specchat.agent.sandbox import SandboxError, Workspace, cap_text, run_workspace, shell_argv
from specchat.agent.tools import ToolOptions, ToolsConfig, build_toolbox
from specchat.agent.trace import RunStart, TracePrinter
from specchat.errors import ConfigError

DETECTED = detect_isolation()
ISOLATIONS = {
    "namespaces": DETECTED if DETECTED.namespaces else None,
    "cgroup": Isolation(namespaces=False, pids_cgroup=DETECTED.pids_cgroup) if DETECTED.pids_cgroup else None,
    "proc-scan": Isolation(namespaces=False),
}
REPO = Path(__file__).parents[2]


@pytest.fixture(params=list(ISOLATIONS))
def isolation(request) -> Isolation:
    found = ISOLATIONS[request.param]
    if found is None:
        pytest.skip(f"{request.param}: not available on this machine")
    return found


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    """An empty workspace; a process still running in it afterwards is killed and fails the test."""
    folder = (tmp_path / "work").resolve()
    folder.mkdir()
    yield folder
    left = processes_in(folder)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"processes left running in the workspace: {left}"


def processes_in(folder: Path) -> list[int]:
    """The live processes whose working directory is in `folder` (zombies have none)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and Path(os.readlink(f"/proc/{name}/cwd")).is_relative_to(folder):
                found.append(int(name))
        except OSError:
            continue
    return found


def python(code: str, workspace: Path, isolation: Isolation, timeout_s: float = 60, **limits) -> ProcessResult:
    return run_python(code, workspace, timeout_s, 4000, ProcessLimits(**limits), isolation)


@pytest.fixture
def room(tmp_path: Path) -> Workspace:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "notes.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    return Workspace(tmp_path / "ws")


def test_relative_and_absolute_paths_inside_are_allowed(room: Workspace):
    assert room.resolve("notes.txt") == room.root / "notes.txt"
    assert room.resolve("sub/../notes.txt") == room.root / "notes.txt"
    assert room.resolve(str(room.root / "notes.txt")) == room.root / "notes.txt"
    assert room.read_text("./notes.txt") == "inside\n"


def test_dotdot_traversal_is_refused(room: Workspace):
    with pytest.raises(SandboxError, match=r"'\.\.'"):
        room.read_text("../secret.txt")
    with pytest.raises(SandboxError, match=r"'\.\.'"):
        room.write_text("sub/../../secret.txt", "x")
    assert (room.root.parent / "secret.txt").read_text() == "outside\n"


def test_absolute_path_outside_is_refused(room: Workspace):
    with pytest.raises(SandboxError, match="absolute path"):
        room.read_text(str(room.root.parent / "secret.txt"))
    with pytest.raises(SandboxError, match="absolute path"):
        room.list_dir("/")


def test_symlink_escapes_are_refused(room: Workspace):
    os.symlink(room.root.parent / "secret.txt", room.root / "link.txt")
    os.symlink(room.root.parent, room.root / "up")
    os.symlink(room.root.parent / "new.txt", room.root / "dangling.txt")
    with pytest.raises(SandboxError, match="symlink"):
        room.read_text("link.txt")
    with pytest.raises(SandboxError, match="symlink"):
        room.read_text("up/secret.txt")
    with pytest.raises(SandboxError, match="symlink"):
        room.write_text("dangling.txt", "escaped")
    assert not (room.root.parent / "new.txt").exists()


def test_symlink_inside_the_workspace_is_fine(room: Workspace):
    os.symlink(room.root / "notes.txt", room.root / "alias.txt")
    assert room.read_text("alias.txt") == "inside\n"


def test_file_operations(room: Workspace):
    assert room.write_text("out/result.txt", "391") == "out/result.txt"
    assert room.read_text("out/result.txt") == "391"
    assert room.list_dir(".") == ["notes.txt", "out/"]
    (room.root / "blob.bin").write_bytes(b"\x00\x01")
    with pytest.raises(SandboxError, match="not a text file"):
        room.read_text("blob.bin")
    with pytest.raises(SandboxError, match="no such file"):
        room.read_text("missing.txt")
    with pytest.raises(SandboxError, match="directory"):
        room.read_text("out")


def test_hard_links_are_refused(room: Workspace):
    outside = room.root.parent / "secret.txt"
    os.link(outside, room.root / "linked.txt")
    with pytest.raises(SandboxError, match=r"'linked\.txt' has 2 hard links"):
        room.read_text("linked.txt")
    with pytest.raises(SandboxError, match="hard links"):
        room.write_text("linked.txt", "overwritten")
    assert outside.read_text() == "outside\n"
    os.link(room.root / "notes.txt", room.root / "twin.txt")  # both inside: refused all the same
    with pytest.raises(SandboxError, match="hard links"):
        room.read_text("notes.txt")


def test_fifos_sockets_and_devices_are_refused_without_blocking(room: Workspace):
    os.mkfifo(room.root / "pipe")
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(room.root / "sock"))
    kinds = {"pipe": "named pipe (FIFO)", "sock": "socket"}
    try:  # only real root may make a device node
        os.mknod(room.root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        kinds["null"] = "character device"
    except PermissionError:
        pass
    try:
        for name, kind in kinds.items():
            with pytest.raises(SandboxError, match=re.escape(f"'{name}' is a {kind}")):
                room.read_text(name)
            with pytest.raises(SandboxError, match=re.escape(f"'{name}' is a {kind}")):
                room.write_text(name, "x")
    finally:
        listening.close()
    assert room.list_dir(".") == sorted(["notes.txt", *kinds])


def test_file_tools_on_a_fifo_return_at_once_and_leave_no_thread(tmp_path: Path):
    os.mkfifo(tmp_path / "pipe")
    box = build_toolbox(ToolsConfig({"read_file": ToolOptions(), "write_file": ToolOptions()}), tmp_path)
    threads, started = threading.active_count(), time.monotonic()
    read = box.call("read_file", {"path": "pipe"})
    written = box.call("write_file", {"path": "pipe", "content": "x"})
    assert time.monotonic() - started < 5  # a blocked open would have waited the 10 s timeout
    assert not read.ok and not written.ok and "FIFO" in read.error and "FIFO" in written.error
    deadline = time.monotonic() + 5
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == threads


def test_workspace_copy_skips_fifos(tmp_path: Path):
    (tmp_path / "a.txt").write_text("a")
    os.mkfifo(tmp_path / "pipe")
    with run_workspace(tmp_path, copy=True) as copy:
        assert sorted(path.name for path in copy.iterdir()) == ["a.txt"]


def test_python_prints_output_and_the_last_expression(workspace: Path):
    result = run_python("x = 17 * 23\nprint('x is', x)\nx + 1", workspace, timeout_s=20, output_cap=1000)
    assert result.returncode == 0 and not result.timed_out
    assert result.output == "x is 391\n392\n"


def test_python_runs_in_the_workspace_with_a_clean_environment(workspace: Path, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SPECCHAT_TEST_SECRET", "s3cret")
    (workspace / "helper.py").write_text("VALUE = 42\n")
    code = "import os, helper\nprint(os.getcwd())\nprint(helper.VALUE)\nprint(sorted(os.environ))"
    result = run_python(code, workspace, timeout_s=20, output_cap=4000)
    cwd, value, names = result.output.splitlines()
    assert Path(cwd).resolve() == workspace
    assert value == "42"
    assert "HTTPS_PROXY" not in names and "SPECCHAT_TEST_SECRET" not in names


def test_python_error_shows_the_traceback_of_the_code(workspace: Path):
    result = run_python("a = 1\n1 / 0", workspace, timeout_s=20, output_cap=1000)
    assert result.returncode == 1
    assert 'File "<agent>", line 2' in result.output and "ZeroDivisionError" in result.output


def test_python_timeout_kills_the_process(workspace: Path):
    result = run_python("while True:\n    pass", workspace, timeout_s=0.5, output_cap=1000)
    assert result.timed_out and result.returncode is None


def test_the_limits_reach_the_command(workspace: Path, isolation: Isolation):
    code = "import resource as r\n[r.getrlimit(getattr(r, 'RLIMIT_' + n))[0] for n in ('AS', 'CPU', 'FSIZE')]"
    result = python(code, workspace, isolation, memory_mb=512, cpu_s=7, file_mb=3)
    assert result.output == f"[{512 * 2**20}, 7, {3 * 2**20}]\n"


FORK_BOMB = """
import os, time
forked = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        forked += 1
except OSError as error:
    print("fork refused:", error.strerror)
print("forked", forked)
"""


def test_a_fork_bomb_is_contained(workspace: Path, isolation: Isolation):
    if not isolation.limits_processes:
        pytest.skip("root without a pids cgroup: nothing here limits the process count")
    result = python(FORK_BOMB, workspace, isolation, max_processes=16)
    assert "fork refused: Resource temporarily unavailable" in result.output
    assert int(result.output.split("forked")[1]) < 40  # 16 tasks, give or take the user's other processes
    assert processes_in(workspace) == []


def test_a_memory_hog_fails_at_its_limit(workspace: Path):
    result = python("hog = bytearray(2 * 1024**3)\nprint('allocated')", workspace, DETECTED, memory_mb=256)
    assert result.returncode == 1 and "MemoryError" in result.output and "allocated" not in result.output


def test_a_cpu_spinner_is_killed_at_its_cpu_limit(workspace: Path):
    started = time.monotonic()
    result = python("while True:\n    pass", workspace, DETECTED, timeout_s=120, cpu_s=1)
    assert result.returncode == -signal.SIGXCPU and not result.timed_out
    assert time.monotonic() - started < 60


def test_a_big_file_write_stops_at_the_file_size_limit(workspace: Path):
    code = "with open('big.bin', 'wb') as file:\n    file.write(b'x' * 5 * 1024**2)"
    result = python(code, workspace, DETECTED, file_mb=1)
    assert result.returncode == 1 and "File too large" in result.output
    assert (workspace / "big.bin").stat().st_size == 1024**2
    shell = run_confined(
        ["dd", "if=/dev/zero", "of=dd.bin", "bs=1M", "count=5"], workspace, 60, 1000, ProcessLimits(file_mb=1)
    )
    assert shell.returncode == -signal.SIGXFSZ and (workspace / "dd.bin").stat().st_size == 1024**2


SETSID_CHILDREN = """
import os, subprocess, time
subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:  # a daemon: fork, setsid, fork again and let the middle one exit
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
time.sleep(0.5)
print("started")
"""


def test_setsid_children_are_killed_when_the_tool_returns(workspace: Path, isolation: Isolation):
    result = python(SETSID_CHILDREN, workspace, isolation)
    assert result.returncode == 0 and result.output == "started\n"
    assert processes_in(workspace) == []


def test_setsid_children_are_killed_at_the_timeout(workspace: Path, isolation: Isolation):
    result = python(SETSID_CHILDREN + "time.sleep(300)\n", workspace, isolation, timeout_s=3)
    assert result.timed_out
    assert processes_in(workspace) == []


KILL_THE_LAUNCHER = """
import os, signal, subprocess, time
subprocess.Popen(["sleep", "300"], start_new_session=True)
time.sleep(1)  # several /proc scans see the sleeper
os.kill(os.getppid(), signal.SIGKILL)  # the launcher (as PID 1 of a namespace, it ignores this)
time.sleep(300)
"""


def test_a_killed_launcher_lets_nothing_escape(workspace: Path, isolation: Isolation):
    result = python(KILL_THE_LAUNCHER, workspace, isolation, timeout_s=4)
    assert result.timed_out or result.returncode == -signal.SIGKILL
    assert processes_in(workspace) == []


SPECCHAT_ENDED_MID_CALL = """
import sys
from pathlib import Path
from specchat.agent.isolation import Isolation
from specchat.agent.processes import ProcessLimits, run_python
workspace, namespaces, cgroup = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] or None
code = "import pathlib, subprocess, time; subprocess.Popen(['sleep', '300']); pathlib.Path('started').touch(); "
code += "time.sleep(300)"
run_python(code, workspace, 300, 4000, ProcessLimits(), Isolation(namespaces, cgroup and Path(cgroup)))
"""


@pytest.mark.parametrize("ending", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_call_ends_with_the_specchat_that_made_it(workspace: Path, isolation: Isolation, ending: int):
    """specchat ended mid-call (`timeout`, a CI job cancelled, the OOM killer) left the call's command running and
    its launcher reaping for good, since only specchat ever killed it."""
    argv = [str(workspace), "1" if isolation.namespaces else "0", str(isolation.pids_cgroup or "")]
    specchat = subprocess.Popen([sys.executable, "-c", SPECCHAT_ENDED_MID_CALL, *argv], cwd=REPO)
    deadline = time.monotonic() + 60
    while not (workspace / "started").exists() and time.monotonic() < deadline:
        assert specchat.poll() is None, "the call did not start"
        time.sleep(0.05)
    assert processes_in(workspace), "the call's processes are not running"
    specchat.send_signal(ending)
    specchat.wait()
    deadline = time.monotonic() + 10
    while processes_in(workspace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_in(workspace) == []


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP server on this machine's loopback; nothing in the sandbox may reach it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


PLAIN_PYTHON_CONNECT = """
import _socket, socket
for make in (socket.socket, _socket.socket):
    try:
        make().connect(("127.0.0.1", {port}))
        print("connected")
    except OSError as error:
        print(type(error).__name__, error)
"""


def test_plain_python_cannot_open_a_socket(workspace: Path, isolation: Isolation, listener: socket.socket):
    result = python(PLAIN_PYTHON_CONNECT.format(port=listener.getsockname()[1]), workspace, isolation)
    assert result.output.splitlines() == ["PermissionError network access is disabled in the specchat python tool"] * 2
    result = python("import urllib.request\nurllib.request.urlopen('http://example.com')", workspace, isolation)
    assert result.returncode == 1 and "network access is disabled" in result.output


@pytest.mark.skipif(not DETECTED.namespaces, reason="no unprivileged user namespaces here")
def test_the_network_namespace_stops_child_processes(workspace: Path, listener: socket.socket):
    child = f"import socket; socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=5)"
    code = (
        "import subprocess, sys\n"
        f"r = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
        "print(r.returncode, r.stderr.strip().splitlines()[-1])"
    )
    result = python(code, workspace, DETECTED)
    assert result.output.startswith("1 OSError: [Errno 101] Network is unreachable")


def test_without_namespaces_python_is_refused_unless_the_script_allows_it(workspace: Path, listener: socket.socket):
    bare = Isolation(namespaces=False)
    refused = build_toolbox(ToolsConfig({"python": ToolOptions()}), workspace, isolation=bare)
    result = refused.call("python", {"code": "print(1)"})
    assert (
        not result.ok
        and "allow_unsandboxed = true" in result.error
        and "no unprivileged user namespaces" in result.error
    )
    allowed = build_toolbox(ToolsConfig({"python": ToolOptions(allow_unsandboxed=True)}), workspace, isolation=bare)
    assert allowed.call("python", {"code": "print(1)"}).content == "1\n"
    connect = allowed.call("python", {"code": PLAIN_PYTHON_CONNECT.format(port=listener.getsockname()[1])})
    assert "connected" not in connect.content and "PermissionError" in connect.content


ENVIRONMENT_PROBE = """
import os, subprocess
def count(read):
    found = 0
    for pid in [name for name in os.listdir("/proc") if name.isdigit()] + [str(os.getppid())]:
        try:
            found += {token!r}.encode() in read(f"/proc/{{pid}}/environ")
        except OSError:
            pass
    return found
def with_open(path):
    with open(path, "rb") as file:
        return file.read()
def with_cat(path):
    return subprocess.run(["cat", path], capture_output=True).stdout
print("own", "PATH=" in with_open("/proc/self/environ").decode())
print("open", count(with_open))
if {thorough}:  # processes the audit hook does not bind, and the machine's own /proc
    print("cat", count(with_cat))
    import ctypes
    print("umount", ctypes.CDLL(None).umount2(b"/proc", 2))
    print("cat", count(with_cat))
"""


def test_the_parents_environment_is_not_readable(workspace: Path, isolation: Isolation):
    token = f"specchat-test-{os.getpid()}-{time.monotonic_ns()}"
    code = ENVIRONMENT_PROBE.format(token=token, thorough=isolation.namespaces)
    driver = (
        "import json, sys\nfrom pathlib import Path\n"
        "from specchat.agent.isolation import Isolation\nfrom specchat.agent.processes import run_python\n"
        "namespaces, cgroup = json.loads(sys.argv[1])\n"
        "isolation = Isolation(namespaces, Path(cgroup) if cgroup else None)\n"
        "print(run_python(sys.stdin.read(), Path(sys.argv[2]), 60, 4000, isolation=isolation).output, end='')"
    )
    argv = [
        sys.executable,
        "-c",
        driver,
        json.dumps([isolation.namespaces, isolation.pids_cgroup and str(isolation.pids_cgroup)]),
    ]
    env = {**os.environ, "SPECCHAT_PARENT_SECRET": token}  # the parent holds it; the tool must not see it
    completed = subprocess.run(
        [*argv, str(workspace)], input=code, env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = completed.stdout.splitlines()
    assert lines[:2] == ["own True", "open 0"], completed.stderr
    if isolation.namespaces:
        assert lines[2:] == ["cat 0", "umount 0", "cat 0"]


def test_oversized_output_is_truncated_with_a_marker(workspace: Path):
    result = run_python("print('a' * 50_000 + 'END')", workspace, timeout_s=20, output_cap=1000)
    assert result.truncated
    assert "[... output truncated:" in result.output
    assert len(result.output) < 1200
    assert result.output.startswith("aaa") and result.output.rstrip().endswith("END")


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="memory_mb must be >= 64"):
        ProcessLimits(memory_mb=10)
    with pytest.raises(ConfigError, match="max_processes must be a positive integer"):
        ProcessLimits(max_processes=0)


def test_the_trace_header_says_what_confines_the_tools():
    def header(isolation: Isolation, tools: list[str]) -> str:
        start = RunStart(0, "t", "m", "none", 0, tools, 4, sandbox=isolation.describe())
        return "\n".join(TracePrinter(io.StringIO()).format(start))

    assert "sandbox: user, network and PID namespaces" in header(Isolation(namespaces=True), ["python"])
    bare = header(Isolation(namespaces=False), ["shell"])
    assert "sandbox: no user namespaces here" in bare and "allow_unsandboxed = true" in bare
    assert "sandbox" not in header(Isolation(namespaces=False), ["read_file"])
    assert RunStart(0, "t", "m", "none", 0, [], 4).sandbox == DETECTED.describe()


def test_cap_text_keeps_head_and_tail():
    text = "HEAD" + "x" * 1000 + "TAIL"
    capped = cap_text(text, 200)
    assert capped.startswith("HEAD") and capped.endswith("TAIL")
    assert "[... output truncated: 808 characters omitted ...]" in capped
    assert cap_text("short", 200) == "short"


def test_shell_argv_allows_listed_commands_only():
    assert shell_argv("grep -n 'a b' notes.txt", ("grep",)) == ["grep", "-n", "a b", "notes.txt"]
    with pytest.raises(SandboxError, match="'rm' is not allowed"):
        shell_argv("rm -rf .", ("ls", "grep"))
    with pytest.raises(SandboxError, match="not allowed"):
        shell_argv("/tmp/ls", ("ls",))
    with pytest.raises(SandboxError, match="no pipes"):
        shell_argv("ls | grep x", ("ls", "grep"))
    with pytest.raises(SandboxError, match="no pipes"):
        shell_argv("ls > out.txt", ("ls",))
    with pytest.raises(SandboxError, match="split"):
        shell_argv("ls 'unclosed", ("ls",))


def test_run_confined_runs_a_command_in_the_workspace(workspace: Path):
    (workspace / "a.txt").write_text("hello\n")
    result = run_confined(["cat", "a.txt"], workspace, timeout_s=20, output_cap=1000)
    assert (result.returncode, result.output) == (0, "hello\n")
    with pytest.raises(SandboxError, match="command not found"):
        run_confined(["no-such-command-xyz"], workspace, timeout_s=20, output_cap=1000)


def test_run_workspace_copy_and_scratch(tmp_path: Path):
    (tmp_path / "src.txt").write_text("original")
    with run_workspace(tmp_path, copy=True) as copy:
        assert copy != tmp_path
        (copy / "src.txt").write_text("changed")
    assert (tmp_path / "src.txt").read_text() == "original"
    assert not copy.exists()
    with run_workspace(None, copy=False) as scratch:
        assert list(scratch.iterdir()) == []
    with run_workspace(tmp_path, copy=False) as same:
        assert same == tmp_path


def test_the_docs_show_the_markers_the_tools_write(workspace: Path):
    """docs/agents.md showed "N bytes omitted" alone; the cap of in-process results counts characters."""
    import re

    marker = r"\[\.\.\. output truncated: [^\]]*\]"

    def markers(text: str) -> set[str]:
        return {re.sub(r"\d+", "N", re.sub(r"\s+", " ", found)) for found in re.findall(marker, text)}

    docs = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    process = run_python("print('a' * 5_000)", workspace, timeout_s=20, output_cap=1000).output
    assert markers(process) == {"[... output truncated: N bytes omitted ...]"}
    assert markers(cap_text("x" * 500, 200)) == {"[... output truncated: N characters omitted ...]"}
    assert markers(docs) == markers(process) | markers(cap_text("x" * 500, 200))
