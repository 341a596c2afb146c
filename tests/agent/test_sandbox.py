"""The sandbox refuses what it promises to refuse: escapes, runaway processes, network, unlisted commands."""

import os
import re
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from specchat.agent.sandbox import (
    SandboxError,
    Workspace,
    cap_text,
    network_namespace_available,
    run_confined,
    run_python,
    run_workspace,
    shell_argv,
)
from specchat.agent.tools import ToolOptions, ToolsConfig, build_toolbox


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


def test_python_prints_output_and_the_last_expression(tmp_path: Path):
    result = run_python("x = 17 * 23\nprint('x is', x)\nx + 1", tmp_path, timeout_s=20, output_cap=1000)
    assert result.returncode == 0 and not result.timed_out
    assert result.output == "x is 391\n392\n"


def test_python_runs_in_the_workspace_with_a_clean_environment(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("SPECCHAT_TEST_SECRET", "s3cret")
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    code = "import os, helper\nprint(os.getcwd())\nprint(helper.VALUE)\nprint(sorted(os.environ))"
    result = run_python(code, tmp_path, timeout_s=20, output_cap=4000)
    cwd, value, names = result.output.splitlines()
    assert Path(cwd).resolve() == tmp_path.resolve()
    assert value == "42"
    assert "HTTPS_PROXY" not in names and "SPECCHAT_TEST_SECRET" not in names


def test_python_error_shows_the_traceback_of_the_code(tmp_path: Path):
    result = run_python("a = 1\n1 / 0", tmp_path, timeout_s=20, output_cap=1000)
    assert result.returncode == 1
    assert 'File "<agent>", line 2' in result.output and "ZeroDivisionError" in result.output


def test_python_timeout_kills_the_process(tmp_path: Path):
    result = run_python("while True:\n    pass", tmp_path, timeout_s=0.5, output_cap=1000)
    assert result.timed_out and result.returncode is None


def test_python_network_is_refused(tmp_path: Path):
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e)"
    )
    result = run_python(code, tmp_path, timeout_s=20, output_cap=1000)
    assert result.output.startswith("PermissionError network access is disabled")
    result = run_python("import urllib.request\nurllib.request.urlopen('http://example.com')", tmp_path, 20, 2000)
    assert result.returncode == 1 and "network access is disabled" in result.output


@pytest.mark.skipif(not network_namespace_available(), reason="no unprivileged network namespaces here")
def test_network_namespace_covers_child_processes(tmp_path: Path):
    child = "import socket; socket.socket().connect(('1.1.1.1', 80))"
    code = (
        "import subprocess, sys\n"
        f"r = subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True)\n"
        "print(r.stderr.strip().splitlines()[-1])"
    )
    result = run_python(code, tmp_path, timeout_s=20, output_cap=2000)
    assert "Network is unreachable" in result.output


def test_oversized_output_is_truncated_with_a_marker(tmp_path: Path):
    result = run_python("print('a' * 50_000 + 'END')", tmp_path, timeout_s=20, output_cap=1000)
    assert result.truncated
    assert "[... output truncated:" in result.output
    assert len(result.output) < 1200
    assert result.output.startswith("aaa") and result.output.rstrip().endswith("END")


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


def test_run_confined_runs_a_command_in_the_workspace(tmp_path: Path):
    (tmp_path / "a.txt").write_text("hello\n")
    result = run_confined(["cat", "a.txt"], tmp_path, timeout_s=20, output_cap=1000)
    assert (result.returncode, result.output) == (0, "hello\n")
    with pytest.raises(SandboxError, match="command not found"):
        run_confined(["no-such-command-xyz"], tmp_path, timeout_s=20, output_cap=1000)


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
