"""Agent tools as the model sees them: JSON-schema descriptions, the built-ins, bounded calls."""

from __future__ import annotations

import difflib
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specchat.agent.isolation import Isolation, detect_isolation
from specchat.agent.processes import CANCEL_POLL_S, ProcessLimits, ProcessResult, run_confined, run_python
from specchat.agent.sandbox import SandboxError, Workspace, cap_text, shell_argv
from specchat.errors import ConfigError

BUILTIN_TOOLS = ("python", "read_file", "write_file", "list_dir", "shell", "final_answer")
FINAL_ANSWER = "final_answer"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_OUTPUT_CAP = 4000  # characters of one tool result the model sees
MIN_OUTPUT_CAP = 200
MAX_TIMEOUT_S = 600.0
TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}

UNSANDBOXED_REFUSAL = (
    "the python tool is off: this machine has no unprivileged user namespaces, so its code would reach the "
    "network and read other processes of the user; the script can allow it with [tools.python] "
    "allow_unsandboxed = true"
)

ConfirmFn = Callable[[str], bool]  # gets the command line, returns whether the user allows it


@dataclass(slots=True)
class ToolResult:
    """The outcome of one tool call; failures are results too, never exceptions. Its text is valid Unicode: bytes
    that are not UTF-8 (a file name on disk, a tool's odd string) show as backslash escapes, where they had made the
    next prompt fail to encode and ended the run."""

    ok: bool
    content: str
    error: str | None = None

    def __post_init__(self) -> None:
        self.content = valid_text(self.content)
        self.error = None if self.error is None else valid_text(self.error)


def valid_text(text: str) -> str:
    """`text` with its lone surrogates as backslash escapes: those of undecodable bytes (os.listdir's
    surrogateescape) as the bytes they stand for, `\\xff`, any other as `\\ud800`."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(slots=True)
class ToolOptions:
    """Limits and settings of one tool."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    output_cap: int = DEFAULT_OUTPUT_CAP
    allow: tuple[str, ...] = ()  # shell only: the command names it may run
    confirm: bool = True  # shell only: ask the user before each command
    limits: ProcessLimits = field(default_factory=ProcessLimits)  # python and shell: per call
    allow_unsandboxed: bool = False  # python only: run it even without user namespaces

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {self.timeout_s}")
        if self.output_cap < MIN_OUTPUT_CAP:
            raise ConfigError(f"output_cap must be >= {MIN_OUTPUT_CAP} characters, got {self.output_cap}")
        for name in self.allow:
            if not name or "/" in name or name != name.strip():
                raise ConfigError(f"allow lists bare command names, got {name!r}")


@dataclass(slots=True)
class Tool:
    """A callable the model may invoke, with the JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of an object: {"type": "object", "properties", "required"}
    function: Callable[..., object]  # called with the model's arguments as keywords
    options: ToolOptions = field(default_factory=ToolOptions)
    self_limited: bool = False  # the function enforces the timeout and output cap itself (subprocess tools)

    def __post_init__(self) -> None:
        if not TOOL_NAME.match(self.name):
            raise ConfigError(f"tool name {self.name!r} must be letters, digits, '_' or '-' (at most 64)")

    def schema(self) -> dict[str, Any]:
        """The description a chat template's `tools=` argument takes (HF / OpenAI function convention)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ToolsConfig:
    """The tools a script enables: built-ins with their options, and user tools already loaded."""

    builtin: dict[str, ToolOptions] = field(default_factory=dict)
    user: list[Tool] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in self.builtin:
            if name not in BUILTIN_TOOLS:
                raise ConfigError(f"unknown tool {name!r}{_suggest(name, BUILTIN_TOOLS)}")
        shell = self.builtin.get("shell")
        if shell is not None and not shell.allow:
            raise ConfigError("the shell tool needs an allow list of command names (tools.shell.allow)")
        seen = set(self.builtin)
        for tool in self.user:
            if tool.name in seen:
                raise ConfigError(f"user tool {tool.name!r} has the name of another tool")
            seen.add(tool.name)

    @property
    def names(self) -> list[str]:
        """Every enabled tool name, built-ins first."""
        return [*self.builtin, *(tool.name for tool in self.user)]


class Toolbox:
    """The tools of one run: schemas for the chat template, and calls that always return a ToolResult."""

    def __init__(self, tools: Sequence[Tool], cancelled: threading.Event | None = None) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.cancelled = cancelled or threading.Event()  # set: calls in flight stop waiting (Ctrl-C)

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's description, for `tools=`."""
        return [tool.schema() for tool in self.tools.values()]

    def call(self, name: str, arguments: object) -> ToolResult:
        """Run one call within its tool's timeout and output cap; every failure comes back as a result."""
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(False, "", f"unknown tool {name!r}; available: {', '.join(self.tools)}")
        try:
            checked = check_arguments(tool, arguments)
        except ValueError as error:
            return ToolResult(False, "", str(error))
        if tool.self_limited:
            return _invoke(tool, checked)
        result = _invoke_with_timeout(tool, checked, self.cancelled)
        result.content = cap_text(result.content, tool.options.output_cap)
        return result


def check_confirm(config: ToolsConfig, confirm: ConfirmFn | None) -> None:
    """A shell that asks before each command (confirm = true, its default) needs someone to ask: `confirm`."""
    shell = config.builtin.get("shell")
    if shell is not None and shell.confirm and confirm is None:
        raise ConfigError(
            "tools.shell.confirm: the shell asks before each command (confirm = true, the default), which needs "
            "the TUI; set confirm = false"
        )


def build_toolbox(
    config: ToolsConfig,
    workspace: Path,
    confirm: ConfirmFn | None = None,
    isolation: Isolation | None = None,
    cancelled: threading.Event | None = None,
) -> Toolbox:
    """The tools of one run, bound to its workspace; `confirm` asks the user before shell commands (TUI);
    `isolation` is what confines python and shell processes (default: what this machine allows); once
    `cancelled` is set (the session's cancel, Ctrl-C), a call in flight ends at once: its processes are killed
    and an in-process tool is no longer waited for."""
    cancelled = cancelled or threading.Event()
    check_confirm(config, confirm)
    room = Workspace(workspace)
    isolation = isolation or detect_isolation()
    factories = {
        "python": lambda room, options: _python_tool(room, options, isolation, cancelled),
        "read_file": _read_file_tool,
        "write_file": _write_file_tool,
        "list_dir": _list_dir_tool,
        "shell": lambda room, options: _shell_tool(room, options, confirm, isolation, cancelled),
        "final_answer": _final_answer_tool,
    }
    builtins = [factories[name](room, options) for name, options in config.builtin.items()]
    return Toolbox([*builtins, *config.user], cancelled)


def check_arguments(tool: Tool, arguments: object) -> dict[str, Any]:
    """The model's arguments checked against the tool's schema; numbers given for strings become strings."""
    if not isinstance(arguments, dict):
        raise ValueError(f"arguments of {tool.name} must be a JSON object, got {_json_type_name(arguments)}")
    properties: dict[str, Any] = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(properties))
    if unknown:
        raise ValueError(
            f"unknown argument {unknown[0]!r} for {tool.name}; parameters: {', '.join(properties) or 'none'}"
        )
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        raise ValueError(f"missing required argument {missing[0]!r} for {tool.name}")
    checked = dict(arguments)
    for name, value in arguments.items():
        expected = properties[name].get("type")
        if expected == "string" and isinstance(value, int | float) and not isinstance(value, bool):
            checked[name] = str(value)
        elif expected in JSON_TYPES and not _is_json_type(value, expected):
            raise ValueError(f"argument {name!r} of {tool.name} must be {expected}, got {_json_type_name(value)}")
        if "enum" in properties[name] and checked[name] not in properties[name]["enum"]:
            raise ValueError(f"argument {name!r} of {tool.name} must be one of {properties[name]['enum']}")
    return checked


def _invoke(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    """Call the tool's function and turn whatever it returns or raises into a ToolResult."""
    try:
        value = tool.function(**arguments)
        if isinstance(value, ToolResult):
            return value
        if isinstance(value, str):
            return ToolResult(True, value)
        if value is None:
            return ToolResult(True, "(no result)")
        try:
            return ToolResult(True, json.dumps(value, ensure_ascii=False))  # (a cycle raises here)
        except TypeError as error:  # an object JSON cannot hold: its repr would have passed as the tool's answer
            return ToolResult(
                False, "", f"{tool.name} returned a value that is not JSON-serialisable ({error}); a tool returns a "
                "string, a ToolResult or a JSON-serialisable value"
            )  # fmt: skip
    except SandboxError as error:
        return ToolResult(False, "", str(error))
    except (Exception, SystemExit) as error:  # a tool's sys.exit() is its failure, not the agent's
        return ToolResult(False, "", f"{tool.name} raised {type(error).__name__}: {error}")


def _invoke_with_timeout(tool: Tool, arguments: dict[str, Any], cancelled: threading.Event) -> ToolResult:
    """Run an in-process tool on a daemon thread; at the timeout, or once `cancelled` is set, stop waiting (a
    thread cannot be killed)."""
    outcome: list[ToolResult] = []

    def run() -> None:
        try:
            outcome.append(_invoke(tool, arguments))
        except BaseException as error:  # KeyboardInterrupt, asyncio's CancelledError, GeneratorExit raised by the
            # tool's own code (no signal reaches this thread): its failure, where it was a thread's traceback and a
            # result that said "timed out"
            detail = f": {error}" if str(error) else ""
            outcome.append(ToolResult(False, "", f"{tool.name} raised {type(error).__name__}{detail}"))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + tool.options.timeout_s
    while worker.is_alive() and not cancelled.is_set() and (remaining := deadline - time.monotonic()) > 0:
        worker.join(min(remaining, CANCEL_POLL_S))
    if not outcome:
        if cancelled.is_set():
            return ToolResult(False, "", f"{tool.name} was cancelled")
        return ToolResult(False, "", f"{tool.name} timed out after {tool.options.timeout_s:g} s")
    return outcome[0]


def _process_result(result: ProcessResult, options: ToolOptions) -> ToolResult:
    """A subprocess outcome as a tool result: the output, plus an error for a timeout, a limit or a failure."""
    output = result.output or "(no output; print() what you want to see)"
    limits = options.limits
    if result.cancelled:
        return ToolResult(False, result.output, "cancelled; the process was killed")
    if result.timed_out:
        return ToolResult(False, result.output, f"timed out after {options.timeout_s:g} s; the process was killed")
    if result.returncode is not None and result.returncode < 0:
        return ToolResult(False, result.output, _signal_error(-result.returncode, limits))
    if result.returncode != 0:
        error = f"exited with status {result.returncode}"
        if "MemoryError" in result.output[-2000:]:
            error += f" (out of memory: the limit is {limits.memory_mb} MiB per process)"
        elif "File too large" in result.output[-2000:]:
            error += f" (the file size limit is {limits.file_mb} MiB)"
        return ToolResult(False, result.output, error)
    return ToolResult(True, output)


def _signal_error(number: int, limits: ProcessLimits) -> str:
    """'killed by SIGXCPU: ...' for a process that a signal ended, naming the limit that sent it."""
    name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
    reason = {
        signal.SIGXCPU: f": it used up its CPU time limit of {limits.cpu_s} s",
        signal.SIGXFSZ: f": it wrote past the file size limit of {limits.file_mb} MiB",
    }.get(number, "")
    return f"killed by {name}{reason}"


def _object_schema(required: dict[str, str], optional: dict[str, str] | None = None) -> dict[str, Any]:
    """A parameters schema of string arguments, each with its description."""
    described = {**required, **(optional or {})}
    properties = {name: {"type": "string", "description": text} for name, text in described.items()}
    return {"type": "object", "properties": properties, "required": list(required)}


def _python_tool(room: Workspace, options: ToolOptions, isolation: Isolation, cancelled: threading.Event) -> Tool:
    def python(code: str) -> ToolResult:
        if not isolation.namespaces and not options.allow_unsandboxed:
            raise SandboxError(UNSANDBOXED_REFUSAL)
        result = run_python(
            code, room.root, options.timeout_s, options.output_cap, options.limits, isolation, cancelled
        )
        return _process_result(result, options)

    description = (
        "Run Python 3 code in a new process in the workspace directory and return what it prints "
        "(stdout and stderr). The value of a final expression is printed too. No network access."
    )
    parameters = _object_schema({"code": "Python source code to run."})
    return Tool("python", description, parameters, python, options, self_limited=True)


def _shell_tool(
    room: Workspace, options: ToolOptions, confirm: ConfirmFn | None, isolation: Isolation, cancelled: threading.Event
) -> Tool:
    def shell(command: str) -> ToolResult:
        argv = shell_argv(command, options.allow)
        if options.confirm and (confirm is None or not confirm(command)):
            return ToolResult(False, "", "the user did not allow this command")
        result = run_confined(
            argv, room.root, options.timeout_s, options.output_cap, options.limits, isolation, cancelled=cancelled
        )
        return _process_result(result, options)

    description = (
        f"Run one command ({', '.join(options.allow)}) in the workspace directory and return its output. "
        "There is no shell: no pipes, redirection, globbing or chaining."
    )
    parameters = _object_schema({"command": "The command line, e.g. 'ls -l'."})
    return Tool("shell", description, parameters, shell, options, self_limited=True)


def _read_file_tool(room: Workspace, options: ToolOptions) -> Tool:
    parameters = _object_schema({"path": "File path relative to the workspace."})
    return Tool("read_file", "Read a text file from the workspace.", parameters, room.read_text, options)


def _write_file_tool(room: Workspace, options: ToolOptions) -> Tool:
    def write_file(path: str, content: str) -> str:
        return f"wrote {len(content)} characters to {room.write_text(path, content)}"

    description = "Write text to a file in the workspace, replacing it if it exists; parent folders are created."
    parameters = _object_schema({"path": "File path relative to the workspace.", "content": "The new text."})
    return Tool("write_file", description, parameters, write_file, options)


def _list_dir_tool(room: Workspace, options: ToolOptions) -> Tool:
    def list_dir(path: str = ".") -> str:
        return "\n".join(room.list_dir(path)) or "(empty)"

    parameters = _object_schema({}, {"path": "Directory relative to the workspace; default '.'."})
    description = "List the files and folders (marked with /) in a workspace directory."
    return Tool("list_dir", description, parameters, list_dir, options)


def _final_answer_tool(room: Workspace, options: ToolOptions) -> Tool:
    def final_answer(answer: str) -> str | ToolResult:
        if not answer.strip():  # a refusal the model can act on, where it ended the run with no answer
            return ToolResult(False, "", f"argument 'answer' of {FINAL_ANSWER} is empty; call it with the answer")
        return answer

    parameters = _object_schema({"answer": "The answer to the task."})
    return Tool(
        FINAL_ANSWER,
        "Give the final answer to the task; this ends the run.",
        parameters,
        final_answer,
        options,
    )


def _is_json_type(value: object, expected: str) -> bool:
    """Whether a decoded JSON value has the JSON-schema type `expected` (booleans are not numbers)."""
    if isinstance(value, bool) and expected != "boolean":
        return False
    return isinstance(value, JSON_TYPES[expected])


def _json_type_name(value: object) -> str:
    """The JSON type name of a decoded value, for messages to the model."""
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if _is_json_type(value, name):
            return name
    return "null" if value is None else type(value).__name__


def _suggest(name: str, choices: Sequence[str]) -> str:
    """'; did you mean X?' when a close match exists, plus the valid choices."""
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (built-in tools: {', '.join(choices)})"
