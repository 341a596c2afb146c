"""Built-in and user tools through the Toolbox: schemas, bounded calls, failures as results."""

import functools
import os
import re
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specchat.agent.processes import ProcessLimits
from specchat.agent.script import load_script
from specchat.agent.tools import (
    Tool,
    Toolbox,
    ToolOptions,
    ToolResult,
    ToolsConfig,
    build_toolbox,
)
from specchat.agent.usertools import function_tool, load_user_tools, tool
from specchat.errors import ConfigError

FILE_TOOLS = ("read_file", "write_file", "list_dir", "final_answer")


def toolbox(tmp_path: Path, *names: str, ask=None, **shell) -> Toolbox:
    """Built-ins with a 20 s timeout; python runs on machines without user namespaces too (test_sandbox.py tests
    the refusal)."""
    options = {name: ToolOptions(timeout_s=20) for name in names}
    if "python" in names:
        options["python"] = ToolOptions(timeout_s=20, allow_unsandboxed=True)
    if "shell" in names:
        options["shell"] = ToolOptions(timeout_s=20, **shell)
    return build_toolbox(ToolsConfig(options), tmp_path, ask)


def test_schemas_follow_the_hf_function_convention(tmp_path: Path):
    schemas = toolbox(tmp_path, "python", *FILE_TOOLS).schemas()
    assert [s["function"]["name"] for s in schemas] == ["python", *FILE_TOOLS]
    for schema in schemas:
        assert schema["type"] == "function"
        assert set(schema["function"]) == {"name", "description", "parameters"}
        assert schema["function"]["parameters"]["type"] == "object"
    python = schemas[0]["function"]["parameters"]
    assert python["properties"]["code"]["type"] == "string" and python["required"] == ["code"]


def test_python_tool(tmp_path: Path):
    box = toolbox(tmp_path, "python")
    assert box.call("python", {"code": "print(17 * 23)"}) == ToolResult(True, "391\n")
    failed = box.call("python", {"code": "raise ValueError('boom')"})
    assert not failed.ok and failed.error == "exited with status 1" and "ValueError: boom" in failed.content
    silent = box.call("python", {"code": "x = 1"})
    assert silent.ok and "no output" in silent.content


def test_python_tool_timeout_is_an_error_result(tmp_path: Path):
    box = build_toolbox(ToolsConfig({"python": ToolOptions(timeout_s=0.5, allow_unsandboxed=True)}), tmp_path)
    result = box.call("python", {"code": "import time\ntime.sleep(30)"})
    assert not result.ok and "timed out after 0.5 s" in result.error


def cancel_soon(delay_s: float = 0.3) -> threading.Event:
    """An event that a timer sets after `delay_s`: Ctrl-C arriving while a call runs."""
    cancelled = threading.Event()
    threading.Timer(delay_s, cancelled.set).start()
    return cancelled


def cancel_once(path: Path, within_s: float = 30.0) -> tuple[threading.Event, list[float]]:
    """An event set as soon as `path` exists (a call is running: Ctrl-C arriving mid-call), and when it was set. A
    fixed delay raced a loaded machine, where the call had not yet started when it was cancelled."""
    cancelled, at = threading.Event(), []

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        at.append(time.monotonic())
        cancelled.set()

    threading.Thread(target=watch, daemon=True).start()
    return cancelled, at


def test_a_cancelled_python_call_ends_at_once_and_its_process_is_killed(tmp_path: Path):
    options = {"python": ToolOptions(timeout_s=60, allow_unsandboxed=True)}
    cancelled, at = cancel_once(tmp_path / "alive")
    box = build_toolbox(ToolsConfig(options), tmp_path, cancelled=cancelled)
    result = box.call("python", {"code": "import time\nopen('alive', 'w').close()\ntime.sleep(60)\nprint('late')"})
    assert (tmp_path / "alive").exists()  # it was running when cancelled
    assert time.monotonic() - at[0] < 10  # ended at the cancel, not at its 60 s timeout
    assert not result.ok and result.error == "cancelled; the process was killed"


def test_a_cancelled_in_process_tool_is_no_longer_waited_for():
    def blocking() -> str:
        """Block."""
        time.sleep(60)
        return "late"

    box = Toolbox([function_tool(blocking, ToolOptions(timeout_s=60))], cancel_soon())
    started = time.monotonic()
    assert box.call("blocking", {}) == ToolResult(False, "", "blocking was cancelled")
    assert time.monotonic() - started < 10


def test_python_tool_errors_name_the_limit_that_stopped_it(tmp_path: Path):
    limits = ProcessLimits(memory_mb=256, file_mb=1)
    box = build_toolbox(ToolsConfig({"python": ToolOptions(limits=limits, allow_unsandboxed=True)}), tmp_path)
    hog = box.call("python", {"code": "hog = bytearray(2 * 1024**3)"})
    assert not hog.ok and hog.error == "exited with status 1 (out of memory: the limit is 256 MiB per process)"
    big = box.call("python", {"code": "open('big.bin', 'wb').write(b'x' * 2 * 1024**2)"})
    assert not big.ok and big.error == "exited with status 1 (the file size limit is 1 MiB)"


def test_shell_tool_is_limited_too(tmp_path: Path):
    options = ToolOptions(allow=("dd",), confirm=False, limits=ProcessLimits(file_mb=1))
    box = build_toolbox(ToolsConfig({"shell": options}), tmp_path)
    result = box.call("shell", {"command": "dd if=/dev/zero of=big.bin bs=1M count=3"})
    assert not result.ok and result.error == "killed by SIGXFSZ: it wrote past the file size limit of 1 MiB"
    assert (tmp_path / "big.bin").stat().st_size == 1024**2


def test_file_tools_round_trip_and_refuse_escapes(tmp_path: Path):
    box = toolbox(tmp_path, *FILE_TOOLS)
    assert box.call("write_file", {"path": "a/b.txt", "content": "fact: 42"}).ok
    assert box.call("read_file", {"path": "a/b.txt"}) == ToolResult(True, "fact: 42")
    assert box.call("list_dir", {}) == ToolResult(True, "a/")
    assert box.call("list_dir", {"path": "a"}) == ToolResult(True, "b.txt")
    escaped = box.call("read_file", {"path": "../../etc/passwd"})
    assert not escaped.ok and "leave the workspace" in escaped.error
    assert not box.call("write_file", {"path": "/etc/x", "content": ""}).ok


def test_file_tools_refuse_hard_links_and_fifos(tmp_path: Path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "outside.txt").write_text("outside")
    os.link(tmp_path / "outside.txt", tmp_path / "ws" / "linked.txt")
    os.mkfifo(tmp_path / "ws" / "pipe")
    box = toolbox(tmp_path / "ws", *FILE_TOOLS)
    for call in ({"path": "linked.txt"}, {"path": "linked.txt", "content": "x"}):
        result = box.call("read_file" if len(call) == 1 else "write_file", call)
        assert not result.ok and "'linked.txt' has 2 hard links" in result.error
    assert not box.call("read_file", {"path": "pipe"}).ok
    assert (tmp_path / "outside.txt").read_text() == "outside"


def test_final_answer_returns_the_answer_and_takes_numbers(tmp_path: Path):
    box = toolbox(tmp_path, "final_answer")
    assert box.call("final_answer", {"answer": "391"}) == ToolResult(True, "391")
    assert box.call("final_answer", {"answer": 391}) == ToolResult(True, "391")


@pytest.mark.parametrize("answer", ["", " \n\t"])
def test_final_answer_refuses_an_empty_answer(tmp_path: Path, answer: str):
    result = toolbox(tmp_path, "final_answer").call("final_answer", {"answer": answer})
    assert result == ToolResult(False, "", "argument 'answer' of final_answer is empty; call it with the answer")


def test_bad_calls_come_back_as_errors(tmp_path: Path):
    box = toolbox(tmp_path, "python", "read_file")
    assert "unknown tool 'pyhton'" in box.call("pyhton", {"code": ""}).error
    assert "missing required argument 'code'" in box.call("python", {}).error
    assert "unknown argument 'file'" in box.call("read_file", {"file": "a"}).error
    assert "must be string, got boolean" in box.call("read_file", {"path": True}).error
    assert "must be a JSON object" in box.call("python", ["print(1)"]).error


def test_shell_runs_allowed_commands_without_a_shell(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("alpha\nbeta\n")
    box = toolbox(tmp_path, "shell", allow=("grep", "ls"), confirm=False)
    assert box.call("shell", {"command": "grep -n beta notes.txt"}) == ToolResult(True, "2:beta\n")
    refused = box.call("shell", {"command": "rm notes.txt"})
    assert not refused.ok and "not allowed" in refused.error
    assert not box.call("shell", {"command": "grep beta notes.txt | ls"}).ok
    assert (tmp_path / "notes.txt").exists()


def test_shell_asks_for_confirmation(tmp_path: Path):
    asked = []

    def decline(command: str) -> bool:
        asked.append(command)
        return False

    box = toolbox(tmp_path, "shell", allow=("ls",), ask=decline)
    result = box.call("shell", {"command": "ls"})
    assert asked == ["ls"] and not result.ok and "did not allow" in result.error
    approving = toolbox(tmp_path, "shell", allow=("ls",), ask=lambda command: True)
    assert approving.call("shell", {"command": "ls"}).ok


def test_shell_needing_confirmation_cannot_run_headless(tmp_path: Path):
    with pytest.raises(ConfigError, match="confirm = false"):
        toolbox(tmp_path, "shell", allow=("ls",))


def test_in_process_tool_timeout_and_output_cap():
    def slow() -> str:
        """Sleep."""
        import time

        time.sleep(30)
        return "late"

    def chatty() -> str:
        """Talk."""
        return "x" * 10_000

    box = Toolbox([function_tool(slow, ToolOptions(timeout_s=0.2)), function_tool(chatty, ToolOptions(output_cap=500))])
    assert box.call("slow", {}) == ToolResult(False, "", "slow timed out after 0.2 s")
    capped = box.call("chatty", {})
    assert capped.ok and "[... output truncated:" in capped.content and len(capped.content) < 600


def test_user_tool_exceptions_and_values_become_results():
    def explode(n: int) -> str:
        """Fail."""
        raise RuntimeError(f"bad {n}")

    def table(n: int) -> dict:
        """Return structured data."""
        return {"n": n, "square": n * n}

    def leave(n: int) -> str:
        """Exit."""
        raise SystemExit(n)

    box = Toolbox([function_tool(explode), function_tool(table), function_tool(leave)])
    assert box.call("explode", {"n": 3}) == ToolResult(False, "", "explode raised RuntimeError: bad 3")
    assert box.call("leave", {"n": 4}) == ToolResult(False, "", "leave raised SystemExit: 4")  # not "timed out"
    assert box.call("table", {"n": 3}) == ToolResult(True, '{"n": 3, "square": 9}')


def test_a_tools_odd_results_are_its_failures_or_valid_text():
    """A value that does not convert to JSON and a KeyboardInterrupt of the tool's own were a thread's traceback
    and 'timed out'; undecodable bytes (a file name) made the next prompt fail to encode and ended the run."""

    def cycle(n: int) -> dict:
        """A self-referencing dict."""
        value: dict = {"n": n}
        value["self"] = value
        return value

    def interrupt(n: int) -> str:
        """Raises KeyboardInterrupt."""
        raise KeyboardInterrupt

    def name(n: int) -> str:
        """A file name that is not UTF-8, as os.listdir gives it."""
        return b"\xff\xfe-bad.txt".decode("utf-8", "surrogateescape")

    box = Toolbox([function_tool(cycle), function_tool(interrupt), function_tool(name)])
    assert box.call("cycle", {"n": 1}) == ToolResult(False, "", "cycle raised ValueError: Circular reference detected")
    assert box.call("interrupt", {"n": 1}) == ToolResult(False, "", "interrupt raised KeyboardInterrupt")
    assert box.call("name", {"n": 1}) == ToolResult(True, "\\xff\\xfe-bad.txt")
    assert ToolResult(False, "", "x\ud800").error == "x\\ud800"
    for result in (box.call("name", {"n": 1}), ToolResult(True, "\udc80")):
        result.content.encode("utf-8")  # encodes: the prompt it goes into does too


def test_any_base_exception_of_a_tool_is_its_failure_at_once():
    """asyncio's CancelledError (a BaseException) from a tool's own code printed a thread's traceback and the run
    waited the whole timeout for a result that said 'timed out'."""
    import asyncio

    def cancelled(n: int) -> str:
        """Raises CancelledError, as async code run inside a tool can."""
        raise asyncio.CancelledError("task was cancelled")

    def closed(n: int) -> str:
        """Raises GeneratorExit."""
        raise GeneratorExit

    box = Toolbox(
        [function_tool(cancelled, ToolOptions(timeout_s=600)), function_tool(closed, ToolOptions(timeout_s=600))]
    )
    assert box.call("cancelled", {"n": 1}) == ToolResult(
        False, "", "cancelled raised CancelledError: task was cancelled"
    )
    assert box.call("closed", {"n": 1}) == ToolResult(False, "", "closed raised GeneratorExit")


def test_a_value_json_cannot_hold_is_the_tools_error_not_its_repr():
    """A tool returns a string, a ToolResult or a JSON-serialisable value: object() passed as ok with its repr."""

    def opaque(n: int) -> object:
        """Returns an object JSON cannot hold."""
        return object()

    def numbers(n: int) -> list:
        """Returns a JSON list."""
        return [n, {"half": n / 2}]

    box = Toolbox([function_tool(opaque), function_tool(numbers)])
    result = box.call("opaque", {"n": 1})
    assert not result.ok and result.content == ""
    assert result.error.startswith("opaque returned a value that is not JSON-serialisable (Object of type object ")
    assert box.call("numbers", {"n": 3}) == ToolResult(True, '[3, {"half": 1.5}]')


USER_MODULE = '''
from typing import Literal

from specchat.agent import tool


@tool
def convert(amount: float, unit: Literal["km", "mi"], digits: int = 2) -> str:
    """Convert a distance.

    Args:
        amount: The distance to convert.
        unit: The unit it is in; the
            result is in the other one.
        digits (int): Decimal places.
    """
    factor = 1.609344 if unit == "mi" else 1 / 1.609344
    return f"{round(amount * factor, digits)}"


@tool
def tags(words: list[str], note: str | None = None) -> list:
    """Sort words.

    :param words: Words to sort.
    """
    return sorted(words)


def helper(x: int) -> int:
    """Not marked; only loaded when listed."""
    return x + 1
'''


def test_user_tools_from_a_module(tmp_path: Path):
    module = tmp_path / "mytools.py"
    module.write_text(USER_MODULE)
    tools = load_user_tools(module, [], ToolOptions())
    assert [t.name for t in tools] == ["convert", "tags"]
    schema = tools[0].schema()["function"]
    assert schema["description"] == "Convert a distance."
    assert schema["parameters"] == {
        "type": "object",
        "properties": {
            "amount": {"type": "number", "description": "The distance to convert."},
            "unit": {
                "type": "string",
                "enum": ["km", "mi"],
                "description": "The unit it is in; the result is in the other one.",
            },
            "digits": {"type": "integer", "description": "Decimal places."},
        },
        "required": ["amount", "unit"],
    }
    words = tools[1].parameters["properties"]
    assert words["words"] == {"type": "array", "items": {"type": "string"}, "description": "Words to sort."}
    assert words["note"] == {"type": "string"}
    box = Toolbox(tools)
    assert box.call("convert", {"amount": 10, "unit": "mi"}) == ToolResult(True, "16.09")
    assert "must be one of" in box.call("convert", {"amount": 1, "unit": "ft"}).error
    listed = load_user_tools(module, ["helper"], ToolOptions())
    assert [t.name for t in listed] == ["helper"]


@pytest.mark.parametrize(
    ("source", "names", "message"),
    [
        ("def f(x: int) -> int:\n    return x\n", [], "no @tool functions"),
        ("def f(x: int) -> int:\n    return x\n", ["g"], "has no function 'g'"),
        ("import no_such_module_xyz\n", [], "importing .* failed: ModuleNotFoundError"),
        ("import sys\nsys.exit(3)\n", [], "importing .* failed: SystemExit: 3"),
        (
            "from specchat.agent import tool\n@tool\ndef f(x):\n    return x\n",
            [],
            "parameter 'x' of f needs a type annotation",
        ),
        (
            "from specchat.agent import tool\n@tool\ndef f(*args: int):\n    return 1\n",
            [],
            r"\*args and \*\*kwargs",
        ),
        (
            "from specchat.agent import tool\n@tool\ndef f(x: complex):\n    return 1\n",
            [],
            "cannot be described",
        ),
        # a callable without a name of its own ended in AttributeError: 'functools.partial' object has no '__name__'
        (
            "import functools\nfrom specchat.agent import tool\ndef add(a: int, b: int) -> int:\n    return a + b\n"
            "inc = tool(functools.partial(add, b=1))\n",
            [],
            r"bad_tools\.py: 'inc' is of type functools\.partial, not a function defined with def",
        ),
        (
            "from specchat.agent import tool\nclass Lookup:\n    def __call__(self, key: str) -> str:\n"
            "        return key\nlookup = tool(Lookup())\n",
            [],
            r"'lookup' is of type specchat_user_tools\.bad_tools\.Lookup, not a function",
        ),
        ("LIMIT = 3\n", ["LIMIT"], "'LIMIT' is of type int, not a function defined with def"),  # "has no function"
    ],
)
def test_bad_user_tool_modules(tmp_path: Path, source: str, names: list[str], message: str):
    module = tmp_path / "bad_tools.py"
    module.write_text(textwrap.dedent(source))
    with pytest.raises(ConfigError, match=message):
        load_user_tools(module, names, ToolOptions())


def test_function_tool_refuses_a_callable_that_is_no_function():
    """function_tool read `function.__name__`: a functools.partial raised AttributeError, a traceback."""

    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    with pytest.raises(ConfigError, match=r"functools\.partial\(.*\) is of type functools\.partial, not a function"):
        function_tool(functools.partial(add, b=1))


def test_missing_user_module(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        load_user_tools(tmp_path / "nope.py", [], ToolOptions())


def test_tools_config_validation():
    with pytest.raises(ConfigError, match="did you mean 'read_file'"):
        ToolsConfig({"readfile": ToolOptions()})
    with pytest.raises(ConfigError, match="allow list"):
        ToolsConfig({"shell": ToolOptions()})
    clash = Tool("python", "mine", {"type": "object", "properties": {}}, lambda: "x")
    with pytest.raises(ConfigError, match="name of another tool"):
        ToolsConfig({"python": ToolOptions()}, [clash])
    with pytest.raises(ConfigError, match="timeout_s"):
        ToolOptions(timeout_s=0)
    with pytest.raises(ConfigError, match="bare command names"):
        ToolOptions(allow=("/bin/ls",))


def test_tool_decorator_marks_without_wrapping():
    def f() -> str:
        """F."""
        return "f"

    assert tool(f) is f and f() == "f"


def test_script_sets_process_limits_and_the_unsandboxed_opt_in(tmp_path: Path):
    script = tmp_path / "agent.toml"
    script.write_text(
        'tasks = ["x"]\n[tools]\nenabled = ["python", "shell"]\n'
        "[tools.python]\nmemory_mb = 512\ncpu_s = 5\nallow_unsandboxed = true\n"
        '[tools.shell]\nallow = ["ls"]\nconfirm = false\nmax_processes = 8\nfile_mb = 2\n'
    )
    tools = load_script(script).tools.builtin
    assert tools["python"].limits == ProcessLimits(memory_mb=512, cpu_s=5) and tools["python"].allow_unsandboxed
    assert tools["shell"].limits == ProcessLimits(max_processes=8, file_mb=2)
    assert not tools["final_answer"].allow_unsandboxed


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[tools.python]\nmemory_mb = 10", "tools.python: memory_mb must be >= 64, got 10"),
        ("[tools.python]\ncpu_s = 0", "tools.python: cpu_s must be a positive integer, got 0"),
        (  # loaded, then every call failed with the launcher's OverflowError
            "[tools.python]\nmemory_mb = 9223372036854775807",
            "tools.python: memory_mb must be at most 2,147,483,647",
        ),
        ("[tools.shell]\nmax_processes = 99999999", "tools.shell: max_processes must be at most 4,194,304"),
        ("[tools.python]\nfile_mb = 1.5", "tools.python.file_mb must be an integer, got a number 1.5"),
        ('[tools.python]\nallow_unsandboxed = "yes"', "tools.python.allow_unsandboxed must be a boolean"),
        ('[tools.shell]\nallow = ["ls"]\nallow_unsandboxed = true', "unknown key 'tools.shell.allow_unsandboxed'"),
        ("[tools.read_file]\nmemory_mb = 512", "unknown key 'tools.read_file.memory_mb'"),
    ],
)
def test_bad_process_options_name_the_key(tmp_path: Path, table: str, message: str):
    script = tmp_path / "agent.toml"
    script.write_text(f'tasks = ["x"]\n[tools]\nenabled = ["python", "shell", "read_file"]\n{table}\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_script(script)


def test_a_user_modules_prints_at_import_go_to_stderr(tmp_path: Path, capsys):
    """stdout is the agent's trace (JSONL under --json): what a tools module prints goes to stderr instead."""
    module = tmp_path / "noisy_tools.py"
    module.write_text("from specchat.agent import tool\nprint('hello from import')\n@tool\ndef f(x: int) -> int:\n"
                      "    \"\"\"Echo.\"\"\"\n    return x\n")  # fmt: skip
    load_user_tools(module, [], ToolOptions())
    out, err = capsys.readouterr()
    assert "hello from import" in err and out == ""
