"""The agent script: one TOML file naming the model, prompt, tools, tasks, limits and speculation of its runs.

Paths in a script (workspace, tasks_file, tools.user.module, a model given as ./path) are relative to the
script's folder. Every problem is a ConfigError of one line that names the file and the key (docs/agents.md).
"""

from __future__ import annotations

import difflib
import json
import re
import tempfile
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from specchat.agent.demos import Demo, DemoCall, empty_answer
from specchat.agent.isolation import Isolation
from specchat.agent.processes import ProcessLimits
from specchat.agent.tools import (
    BUILTIN_TOOLS,
    DEFAULT_OUTPUT_CAP,
    DEFAULT_TIMEOUT_S,
    FINAL_ANSWER,
    Tool,
    ToolOptions,
    ToolsConfig,
    build_toolbox,
    check_arguments,
)
from specchat.agent.usertools import load_user_tools
from specchat.config import K_MAX_LIMIT, KV_CHOICES, WEIGHT_CHOICES, SamplingParams, SpecParams, check_drafter_name
from specchat.errors import ConfigError, ModelNotFoundError, path_problem
from specchat.registry import resolve

DEFAULT_MODEL = "smollm2-135m"
STOP_KINDS = ("tool", "tag", "regex")
TAG_NAME = re.compile(r"^[A-Za-z][\w.-]*$")
TOP_KEYS = (
    "model",
    "system_prompt",
    "tasks",
    "tasks_file",
    "max_steps",
    "max_wall_s",
    "concurrency",
    "workspace",
    "copy_workspace",
    "sampling",
    "speculation",
    "tools",
    "stop",
    "tool_choice",
    "examples",
    "weights",
    "kv",
)
TOOL_CHOICES = ("auto", "first", "required")
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "seed": int, "max_tokens": int}
TOOL_OPTION_KEYS = ("timeout_s", "output_cap")
LIMIT_KEYS = ("max_processes", "memory_mb", "cpu_s", "file_mb")  # ProcessLimits, for python and shell
PROCESS_TOOL_KEYS = {
    "python": (*TOOL_OPTION_KEYS, *LIMIT_KEYS, "allow_unsandboxed"),
    "shell": (*TOOL_OPTION_KEYS, *LIMIT_KEYS, "allow", "confirm"),
}
TOML_TYPES = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table",
}
T = TypeVar("T")


DEFAULT_K_MAX = SpecParams().k_max
MAX_WALL_S = 365 * 24 * 3600.0  # a run's wall-time limit waits on a lock: inf overflowed its timeout


@dataclass(slots=True)
class StopCondition:
    """When a run has its answer: a call to final_answer, text inside <tag>...</tag>, or a regex match."""

    kind: str = "tool"  # "tool" | "tag" | "regex"
    value: str = FINAL_ANSWER  # the tool name, the tag name or the pattern
    pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in STOP_KINDS:
            raise ConfigError(f"stop kind must be one of {', '.join(STOP_KINDS)}, got {self.kind!r}")
        if self.kind == "tool" and self.value != FINAL_ANSWER:
            raise ConfigError(f"stop.tool must be {FINAL_ANSWER!r}, got {self.value!r}")
        if self.kind == "tag":
            if not TAG_NAME.match(self.value):
                raise ConfigError(f"stop.tag must be a tag name such as 'final', got {self.value!r}")
            tag = re.escape(self.value)
            self.pattern = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL)
        if self.kind == "regex":
            try:
                self.pattern = re.compile(self.value)
            except re.error as error:
                raise ConfigError(f"stop.regex is not a valid regular expression: {error}") from None
            if self.pattern.fullmatch(""):  # it matches any reply: the first one, whatever it says, is the answer
                raise ConfigError(f"stop.regex must not match empty text, got {self.value!r}")

    def answer_in(self, text: str) -> str | None:
        """For tag and regex stops, the answer in a reply (a regex's first group if it has one), else None."""
        match = self.pattern.search(text) if self.pattern is not None else None
        if match is None:
            return None
        return (match.group(1) if self.pattern.groups else match.group(0)).strip()


@dataclass(slots=True)
class AgentScript:
    """A validated agent script; its paths are absolute."""

    path: Path
    tasks: list[str]
    system_prompt: str
    model: str = DEFAULT_MODEL
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    stop: StopCondition = field(default_factory=StopCondition)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpecParams = field(default_factory=lambda: SpecParams(drafter="none"))
    max_steps: int = 8  # model turns per run
    max_wall_s: float = 300.0  # wall time per run
    concurrency: int = 1  # runs in flight at once
    workspace: Path | None = None  # None: each run gets a fresh empty folder
    copy_workspace: bool = False  # each run works on its own copy of the workspace
    tool_choice: str = "auto"  # "first" | "required": those turns are guided tool calls (agent/guided.py)
    examples: list[Demo] = field(default_factory=list)  # worked examples shown before each task
    weights: str = "auto"  # the engine's weights: bf16 | mxfp4 | auto (as the model file stores them)
    kv: str = "auto"  # the KV page format (config.KV_FORMATS) | auto (the model dtype's dense one)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError('no tasks: give tasks = ["..."] or tasks_file = "..."')
        for index, task in enumerate(self.tasks):
            if not task.strip():
                raise ConfigError(f"task {index + 1} is empty")
        if not self.model.strip():
            raise ConfigError("model must not be empty")
        if self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")
        if not 0 < self.max_wall_s <= MAX_WALL_S:
            raise ConfigError(f"max_wall_s must be > 0 and at most {MAX_WALL_S:.0f} (a year), got {self.max_wall_s}")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        workspace_problem = self.workspace and path_problem(self.workspace, str(self.workspace), directory=True)
        if workspace_problem:
            raise ConfigError(f"workspace: {workspace_problem}")
        if self.stop.kind == "tool" and FINAL_ANSWER not in self.tools.builtin:
            raise ConfigError(f"stop.tool needs the {FINAL_ANSWER} tool enabled")
        if self.weights not in WEIGHT_CHOICES:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {self.weights!r}")
        if self.kv not in KV_CHOICES:
            raise ConfigError(f"kv must be one of {', '.join(KV_CHOICES)}, got {self.kv!r}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ConfigError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {self.tool_choice!r}")
        if self.tool_choice != "auto" and not self.tools.names:
            raise ConfigError(f"tool_choice = {self.tool_choice!r} needs at least one tool enabled")
        tools = self._tools_for_examples()
        for index, demo in enumerate(self.examples, 1):
            for number, call in enumerate(demo.calls, 1):
                if call.name not in self.tools.names:
                    raise ConfigError(f"examples[{index}] calls {call.name!r}, which is not an enabled tool")
                try:  # as a run checks a call: an argument misspelt in an example was copied into every run's calls
                    check_arguments(tools[call.name], call.arguments)
                except ValueError as error:
                    raise ConfigError(f"examples[{index}].calls[{number}]: {error}") from None
            if self.stop.kind == "regex" and self.stop.answer_in(demo.answer) is None:
                # the example is the reply that should end a run: one the stop misses teaches replies that never end
                raise ConfigError(f"examples[{index}].answer does not match stop.regex {self.stop.value!r}")
            if (why := empty_answer(demo.answer, self.stop)) is not None:
                # an empty answer does not end a run (final_answer refuses it, the loop nudges an empty tag or
                # match): the example would teach the one answer that is turned back
                raise ConfigError(f"examples[{index}].answer {why}")
        if self.tool_choice == "required" and self.stop.kind != "tool":
            raise ConfigError('tool_choice = "required" makes every turn a tool call: it needs the final_answer stop')

    def _tools_for_examples(self) -> dict[str, Tool]:
        """The enabled tools by name, for checking the examples' calls (their schemas; nothing runs)."""
        if not any(demo.calls for demo in self.examples):
            return {}
        root = self.workspace or Path(tempfile.gettempdir())  # (the file tools are bound to a folder that exists)
        toolbox = build_toolbox(self.tools, root, confirm=lambda command: False, isolation=Isolation(False))
        return toolbox.tools

    @property
    def name(self) -> str:
        """The script's file name without its suffix."""
        return self.path.stem


def load_script(path: str | Path) -> AgentScript:
    """Read and validate an agent script; any problem is one ConfigError line naming the file and the key."""
    path = Path(path)
    try:
        return _parse_script(path)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def default_system_prompt(stop: StopCondition) -> str:
    """The system prompt of a script that gives none; it says how to finish, as the stop condition expects."""
    finish = {
        "tool": f"When you know the answer, call {FINAL_ANSWER} with it.",
        "tag": f"When you know the answer, write it as <{stop.value}>the answer</{stop.value}>.",
        "regex": "When you know the answer, state it.",
    }[stop.kind]
    return f"You are a helpful assistant that solves tasks with tools. Call a tool, read its result. {finish}"


def _parse_script(path: Path) -> AgentScript:
    """The script at `path`, with errors not yet prefixed by the file name."""
    top = _Table(_read_toml(path), "", TOP_KEYS)
    base = path.resolve().parent
    stop = _stop(top.table("stop", STOP_KINDS))
    workspace = top.get("workspace", str, None)
    return AgentScript(
        path=path.resolve(),
        model=_model(top.get("model", str, DEFAULT_MODEL), base),
        system_prompt=top.get("system_prompt", str, None) or default_system_prompt(stop),
        tasks=_tasks(top, base),
        tools=_tools(top.table("tools", ("enabled", *TOOL_OPTION_KEYS, "user", *BUILTIN_TOOLS)), base, stop),
        stop=stop,
        sampling=_sampling(top.table("sampling", tuple(SAMPLING_KEYS))),
        speculation=_speculation(top.table("speculation", ("drafter", "k", "k_max")), base),
        max_steps=top.get("max_steps", int, 8),
        max_wall_s=top.get("max_wall_s", float, 300.0),
        concurrency=top.get("concurrency", int, 1),
        workspace=(base / workspace).resolve() if workspace is not None else None,
        copy_workspace=top.get("copy_workspace", bool, False),
        tool_choice=top.get("tool_choice", str, "auto"),
        examples=_examples(top),
        weights=top.get("weights", str, "auto"),
        kv=top.get("kv", str, "auto"),
    )


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM (Windows editors) is not TOML
    except FileNotFoundError:
        raise ConfigError("no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the script: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"invalid TOML: {error}") from None


def _model(model: str, base: Path) -> str:
    """An alias or hub id unchanged (and known: resolving touches no network); a path (./x, ../x, /x, ~/x or *.gguf)
    made absolute and checked."""
    if not model.startswith(("./", "../", "/", "~")) and not model.endswith(".gguf"):
        try:
            resolve(model)
        except ModelNotFoundError as error:
            raise ConfigError(f"model: {error}") from None
        return model
    path = (base / Path(model).expanduser()).resolve()
    if not path.exists():
        raise ConfigError(f"model: no such file or directory {path}")
    return str(path)


def _tasks(top: _Table, base: Path) -> list[str]:
    """The tasks given inline, or read from tasks_file (one per line, or a TOML file with a tasks array)."""
    inline = top.strings("tasks", None)
    tasks_file = top.get("tasks_file", str, None)
    if inline is not None and tasks_file is not None:
        raise ConfigError("give tasks or tasks_file, not both")
    if tasks_file is None:
        return inline or []
    path = base / tasks_file
    if (why := path_problem(path, str(path))) is not None:
        raise ConfigError(f"tasks_file: {why}")
    if path.suffix == ".toml":
        tasks = _wrap(f"tasks_file {path}", lambda: _Table(_read_toml(path), "", ("tasks",)).strings("tasks", []))
        if not tasks:
            raise ConfigError(f"tasks_file {path} has no tasks: give them as tasks = [...] there")
        return tasks
    try:
        lines = path.read_bytes().decode("utf-8-sig").splitlines()  # a BOM (Windows editors) is no task
    except UnicodeDecodeError as error:
        raise ConfigError(f"tasks_file {path}: not valid UTF-8 (at byte {error.start})") from None
    except OSError as error:
        raise ConfigError(f"tasks_file {path}: cannot read ({error.strerror or error})") from None
    tasks = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not tasks:
        raise ConfigError(f"tasks_file {path} has no tasks: one a line (blank lines and # lines are skipped)")
    return tasks


def _examples(top: _Table) -> list[Demo]:
    """The [[examples]] tables: task, calls (name, arguments, result) and answer of each worked example."""
    demos = []
    for index, item in enumerate(top.get("examples", list, []), 1):
        if not isinstance(item, dict):
            raise ConfigError(f"examples[{index}] must be a table ([[examples]]), got {_describe(item)}")
        table = _Table(item, f"examples[{index}]", ("task", "calls", "answer"))
        task, answer = table.get("task", str, ""), table.get("answer", str, None)
        if not task.strip() or answer is None:
            raise ConfigError(f"examples[{index}] needs a task and an answer")
        calls = []
        for number, call in enumerate(table.get("calls", list, []), 1):
            where = f"examples[{index}].calls[{number}]"
            if not isinstance(call, dict):
                raise ConfigError(f"{where} must be a table, got {_describe(call)}")
            call_table = _Table(call, where, ("name", "arguments", "result"))
            name = call_table.get("name", str, None)
            if name is None:
                raise ConfigError(f"{where} needs a name")
            arguments = call_table.get("arguments", dict, {})
            try:  # the call is shown to the model as JSON; TOML's dates and times are not JSON
                json.dumps(arguments, allow_nan=False)
            except (TypeError, ValueError) as error:
                raise ConfigError(
                    f"{where}.arguments must be JSON values (text, numbers, lists, tables): {error}"
                ) from None
            calls.append(DemoCall(name, arguments, call_table.get("result", str, "")))
        demos.append(Demo(task, answer, calls))
    return demos


def _tools(table: _Table, base: Path, stop: StopCondition) -> ToolsConfig:
    """The [tools] table: enabled built-ins, [tools.NAME] options, [tools.user] module."""
    enabled = table.strings("enabled", [])
    defaults = {
        "timeout_s": table.get("timeout_s", float, DEFAULT_TIMEOUT_S),
        "output_cap": table.get("output_cap", int, DEFAULT_OUTPUT_CAP),
    }
    default_options = _wrap("tools", lambda: ToolOptions(**defaults))
    for name in enabled:
        if name not in BUILTIN_TOOLS:
            close = difflib.get_close_matches(name, BUILTIN_TOOLS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (built-in tools: {', '.join(BUILTIN_TOOLS)})"
            raise ConfigError(f"tools.enabled: unknown tool {name!r}{hint}")
    for name in BUILTIN_TOOLS:
        if name in table.data and name not in enabled:
            raise ConfigError(f"tools.{name} has options but {name!r} is not in tools.enabled")
    builtin = {name: _tool_options(table, name, defaults) for name in dict.fromkeys(enabled)}
    if stop.kind == "tool":
        builtin.setdefault(FINAL_ANSWER, default_options)
    user = []
    if "user" in table.data:
        user_table = table.table("user", ("module", "functions", *TOOL_OPTION_KEYS))
        module = user_table.get("module", str, None)
        if module is None:
            raise ConfigError("tools.user.module is required: the Python file that defines the tools")
        functions = user_table.strings("functions", [])
        options = _wrap("tools.user", lambda: ToolOptions(**_options(user_table, defaults)))
        user = _wrap("tools.user", lambda: load_user_tools(base / module, functions, options))
    return _wrap("tools", lambda: ToolsConfig(builtin, user))


def _tool_options(table: _Table, name: str, defaults: dict[str, Any]) -> ToolOptions:
    """The options of one enabled built-in, from [tools.NAME] over the [tools] defaults."""
    options_table = table.table(name, PROCESS_TOOL_KEYS.get(name, TOOL_OPTION_KEYS))
    options = _options(options_table, defaults)
    if name in PROCESS_TOOL_KEYS:
        limits = {key: options_table.get(key, int, None) for key in LIMIT_KEYS if key in options_table.data}
        options["limits"] = _wrap(f"tools.{name}", lambda: ProcessLimits(**limits))
    if name == "python":
        options["allow_unsandboxed"] = options_table.get("allow_unsandboxed", bool, False)
    if name == "shell":
        options["allow"] = tuple(options_table.strings("allow", []))
        options["confirm"] = options_table.get("confirm", bool, True)
    return _wrap(f"tools.{name}", lambda: ToolOptions(**options))


def _options(table: _Table, defaults: dict[str, Any]) -> dict[str, Any]:
    return {
        "timeout_s": table.get("timeout_s", float, defaults["timeout_s"]),
        "output_cap": table.get("output_cap", int, defaults["output_cap"]),
    }


def _stop(table: _Table) -> StopCondition:
    """The [stop] table: exactly one of tool, tag or regex; final_answer when absent."""
    given = [kind for kind in STOP_KINDS if kind in table.data]
    if not given:
        return StopCondition()
    if len(given) > 1:
        raise ConfigError(f"stop takes one of {', '.join(STOP_KINDS)}, got {' and '.join(given)}")
    return StopCondition(given[0], table.get(given[0], str, None))


def _sampling(table: _Table) -> SamplingParams:
    """The [sampling] table. SamplingParams names a bad value as the CLI flag spells it (`max-tokens must be > 0`);
    the message names the key as the script spells it (`sampling.max_tokens must be > 0`)."""
    values = {key: table.get(key, kind, None) for key, kind in SAMPLING_KEYS.items() if key in table.data}
    try:
        return SamplingParams(**values)
    except ConfigError as error:
        if error.field in SAMPLING_KEYS:
            raise error.named(table.where(error.field)) from None
        raise ConfigError(f"{table.name}: {error}") from None


def _speculation(table: _Table, base: Path) -> SpecParams:
    """The [speculation] table: drafter (config.DRAFTER_SYNTAX), k an integer or "auto"."""
    drafter = table.get("drafter", str, "none")
    try:
        check_drafter_name(drafter)
    except ConfigError as error:
        raise error.named(table.where("drafter")) from None
    family, _, argument = drafter.partition(":")
    if family in ("heads", "ngram+heads") and argument:  # a heads file, relative to the script's folder
        drafter = f"{family}:{(base / Path(argument).expanduser()).resolve()}"
    k = table.data.get("k", 4)
    if k != "auto" and (not isinstance(k, int) or isinstance(k, bool)):
        raise ConfigError(f'speculation.k must be an integer or "auto", got {_describe(k)}')
    k_max = table.get("k_max", int, DEFAULT_K_MAX)
    try:
        return SpecParams(drafter=drafter, k=None if k == "auto" else k, k_max=k_max)
    except ConfigError as error:
        if error.field == "k":
            raise k_bound_error(table.where("k"), error, k_max, "the script") from None
        if error.field == "k_max":
            raise error.named(table.where("k_max")) from None
        raise ConfigError(f"{table.name}: {error}") from None


def k_bound_error(setting: str, error: ConfigError, k_max: int, script: str) -> ConfigError:
    """SpecParams' error about `k` named as the user gave it (`--k`, `speculation.k`), with where its bound comes
    from: the script's speculation.k_max, or its default."""
    if k_max == DEFAULT_K_MAX:
        why = f"the bound is speculation.k_max, {k_max} by default; {script} may set it up to {K_MAX_LIMIT}"
    else:
        why = f"the bound is speculation.k_max = {k_max} in {script}"
    return ConfigError(f"{setting} {error.problem} ({why})")


def _wrap(where: str, build: Callable[[], T]) -> T:
    """Run `build`, naming `where` in the ConfigError it raises."""
    try:
        return build()
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None


def _describe(value: object) -> str:
    """'a string "8"': a TOML value's type and the value, for messages."""
    kind = next((name for kind, name in TOML_TYPES.items() if isinstance(value, kind)), type(value).__name__)
    return f"{kind} {value!r}"


class _Table:
    """A TOML table read key by key with type checks; a key it does not know is an error at once."""

    def __init__(self, data: dict[str, Any], name: str, keys: Sequence[str]) -> None:
        self.data = data
        self.name = name
        for key in data:
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(keys)})"
                raise ConfigError(f"unknown key {self.where(key)!r}{hint}")

    def where(self, key: str) -> str:
        """The dotted name of a key, for messages."""
        return f"{self.name}.{key}" if self.name else key

    def get(self, key: str, kind: type[T], default: Any) -> T:
        """The value of `key` checked to be of `kind` (integers pass as floats, booleans never as numbers)."""
        if key not in self.data:
            return default
        value = self.data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)  # type: ignore[return-value]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ConfigError(f"{self.where(key)} must be {TOML_TYPES[kind]}, got {_describe(value)}")
        return value

    def strings(self, key: str, default: list[str] | None) -> list[str] | None:
        """An array of strings."""
        values = self.get(key, list, default)
        for index, value in enumerate(values or []):
            if not isinstance(value, str):
                raise ConfigError(f"{self.where(key)}[{index}] must be a string, got {_describe(value)}")
        return values

    def table(self, key: str, keys: Sequence[str]) -> _Table:
        """A sub-table (empty when absent) that knows `keys`."""
        return _Table(self.get(key, dict, {}), self.where(key), keys)
