"""User tools: typed Python functions in a module named by the script, described to the model by their signature."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from specchat.agent.tools import Tool, ToolOptions
from specchat.errors import ConfigError, path_problem

TOOL_MARK = "__specchat_tool__"
PYTHON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
F = TypeVar("F", bound=Callable[..., object])


def tool(function: F) -> F:
    """Mark a function in a user tool module as an agent tool; its signature and docstring give the schema."""
    setattr(function, TOOL_MARK, True)
    return function


def load_user_tools(module_path: Path, names: Sequence[str], options: ToolOptions) -> list[Tool]:
    """The tools in a Python file: the functions `names` lists, or else every function marked with @tool."""
    if (why := path_problem(module_path, str(module_path))) is not None:
        raise ConfigError(why)
    module_name = f"specchat_user_tools.{module_path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, module_path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{module_path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the trace's (JSONL under --json)
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # sys.exit() at import ended specchat without a word
        raise ConfigError(f"importing {module_path} failed: {type(error).__name__}: {error}") from None
    if names:
        functions = {name: getattr(module, name, None) for name in names}
        for name, function in functions.items():
            if function is None:
                raise ConfigError(f"{module_path.name} has no function {name!r}")
    else:
        functions = {name: value for name, value in vars(module).items() if getattr(value, TOOL_MARK, False)}
        if not functions:
            raise ConfigError(f"{module_path.name} has no @tool functions; mark some or list them in functions")
    for name, function in functions.items():
        if (why := not_a_function(function)) is not None:
            raise ConfigError(f"{module_path.name}: {name!r} {why}")
    return [function_tool(function, options) for function in functions.values()]


def not_a_function(value: object) -> str | None:
    """Why `value` cannot be a tool, or None: only a function defined with def has the name, docstring and typed
    parameters that describe a tool to the model (a functools.partial or a callable object has no name of its own)."""
    if inspect.isfunction(value):
        return None
    kind = type(value)
    spelled = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"is of type {spelled}, not a function defined with def; wrap it in one with typed parameters"


def function_tool(function: Callable[..., object], options: ToolOptions | None = None) -> Tool:
    """A Tool from a typed Python function: its name, its docstring's summary and Args, its signature."""
    if (why := not_a_function(function)) is not None:
        raise ConfigError(f"{function!r} {why}")
    description, parameters = schema_from_function(function)
    return Tool(function.__name__, description, parameters, function, options or ToolOptions())


def schema_from_function(function: Callable[..., object]) -> tuple[str, dict[str, Any]]:
    """The description and the parameters schema of a function, from its signature and docstring."""
    doc = inspect.getdoc(function) or ""
    arg_docs = _arg_docs(doc)
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:
        raise ConfigError(f"cannot read the type hints of {function.__name__}: {error}") from None
    properties: dict[str, Any] = {}
    required: list[str] = []
    for parameter in inspect.signature(function).parameters.values():
        where = f"parameter {parameter.name!r} of {function.__name__}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigError(f"{where}: *args and **kwargs cannot be described to the model")
        if parameter.name not in hints:
            raise ConfigError(f"{where} needs a type annotation")
        properties[parameter.name] = _json_schema(hints[parameter.name], where)
        if parameter.name in arg_docs:
            properties[parameter.name]["description"] = arg_docs[parameter.name]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    summary = re.split(r"\n\s*\n|\n\s*(?:Args|Arguments|Parameters|Returns|Raises):", doc)[0]
    description = " ".join(summary.split()) or function.__name__
    return description, {"type": "object", "properties": properties, "required": required}


def _json_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one Python type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in PYTHON_TYPES:
        return {"type": PYTHON_TYPES[hint]}
    if hint is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:
            return _json_schema(options[0], where)
        return {"anyOf": [_json_schema(arg, where) for arg in options]}
    if origin is Literal and args and all(type(arg) in PYTHON_TYPES for arg in args):
        return {"type": PYTHON_TYPES[type(args[0])], "enum": list(args)}
    if hint in (list, tuple) or origin in (list, tuple, Sequence):
        items = args[0] if len(args) == 1 or (len(args) == 2 and args[1] is Ellipsis) else None
        return {"type": "array", **({"items": _json_schema(items, where)} if items is not None else {})}
    if hint is dict or origin in (dict, Mapping):
        return {"type": "object"}
    raise ConfigError(f"{where}: type {hint!r} cannot be described to the model")


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style Args section or Sphinx `:param name:` lines."""
    found = {name: text.strip() for name, text in re.findall(r":param\s+(\w+):\s*(.+)", doc)}
    section = re.search(r"^(?:Args|Arguments|Parameters):\n((?:[ \t]+\S.*\n?)+)", doc, re.MULTILINE)
    if section is None:
        return found
    lines = section.group(1).splitlines()
    entry_indent = len(lines[0]) - len(lines[0].lstrip())
    current = None
    for line in lines:
        entry = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
        if entry is not None and len(line) - len(line.lstrip()) == entry_indent:
            current = entry.group(1)
            found[current] = entry.group(2).strip()
        elif current is not None:
            found[current] = f"{found[current]} {line.strip()}"
    return found
