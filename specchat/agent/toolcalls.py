"""Tool calls in model output, in the formats real chat templates emit, and tool results as chat messages.

Formats, tried in this order:
  Hermes / Qwen / SmolLM2  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call or a
                           JSON list in one block; several blocks per reply.
  Llama 3.1                <|python_tag|>{"name": ..., "parameters": {...}} (calls separated by ';'), or raw
                           Python after the tag, which is Llama's code-interpreter call (tool "python").
  plain JSON               any {"name": ..., "arguments" | "parameters": ...} object in the text, fenced or
                           not; this also covers Llama 3.1 JSON calls without the tag.
Malformed calls (invalid or cut-off JSON, no name, arguments that are not an object) become error lines
worded for the model, so the loop can send them back and go on.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from specchat.agent.tools import ToolResult

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")
THINK_BLOCK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)  # reasoning is not acted on
CALL_START = re.compile(r"""\{\s*["'](?:name|function)["']\s*:""")
OPENING_BRACKET = re.compile(r"[{\[]")  # where a call object, or a list of calls, may start
EMPTY_FENCE = re.compile(r"```(?:json)?\s*```")
FORMAT_HINTS = {
    "hermes": '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>',
    "llama": '<|python_tag|>{"name": "TOOL", "parameters": {...}}',
    "json": '{"name": "TOOL", "arguments": {...}}',
}
_DECODER = json.JSONDecoder()
NESTED_TOO_DEEPLY = "arrays and objects nested too deeply"


@dataclass(slots=True)
class ToolCall:
    """One call the model asked for."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_message_part(self) -> dict[str, Any]:
        """The entry of an assistant message's `tool_calls` list (HF chat-template convention)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParsedReply:
    """A model reply split into its visible text, the calls it makes and what could not be parsed."""

    content: str  # the reply without tool-call markup (and without <think> blocks)
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line each, worded for the model
    format: str | None = None  # "hermes" | "llama" | "json"; None when the reply holds no call attempt


class _DecodeError(ValueError):
    """A value that does not decode; `end` is where it ends, None when it is cut off."""

    def __init__(self, message: str, end: int | None) -> None:
        super().__init__(message)
        self.end = end


def parse_tool_calls(text: str, step: int = 0) -> ParsedReply:
    """The tool calls in one reply; `step` makes the call ids unique within a run."""
    text = THINK_BLOCK.sub("", text)
    if HERMES_OPEN in text:
        return _parse_hermes(text, step)
    if PYTHON_TAG in text:
        return _parse_llama(text, step)
    return _parse_json(text, step)


CALL_ID_LENGTH = 9  # alphanumerics: the length of tool call ids Mistral's templates insist on


def call_id(step: int, index: int) -> str:
    """A call id of CALL_ID_LENGTH alphanumerics; unique per (step, index)."""
    return f"c{step:04d}{index:04d}"


class _Collector:
    """Accumulates the calls and errors of one reply."""

    def __init__(self, step: int, call_format: str) -> None:
        self.reply = ParsedReply(content="", format=call_format)
        self.step = step

    def error(self, message: str) -> None:
        self.reply.errors.append(f"{message}. Write a tool call as {FORMAT_HINTS[self.reply.format]}")

    def add(self, value: object) -> None:
        """Record a decoded call, or each call of a decoded list."""
        for item in value if isinstance(value, list) else [value]:
            try:
                name, arguments = _call_parts(item)
            except ValueError as error:
                self.error(str(error))
                continue
            self.reply.calls.append(ToolCall(call_id(self.step, len(self.reply.calls)), name, arguments))

    def add_all(self, body: str) -> None:
        """Record every JSON value in `body`; a value that does not decode becomes an error."""
        try:
            values, _ = _read_values(body, 0, None)
        except _DecodeError as error:
            self.error(f"tool call could not be parsed: {error}")
            return
        self.record(values)

    def record(self, values: list[object]) -> None:
        """Record the values read from one tool-call block; none at all is an error."""
        if not values:
            self.error("empty tool call")
        for value in values:
            self.add(value)

    def finish(self, content: str) -> ParsedReply:
        self.reply.content = EMPTY_FENCE.sub("", content).strip()
        return self.reply


def _parse_hermes(text: str, step: int) -> ParsedReply:
    """<tool_call> blocks; an unclosed last block counts when its JSON is whole (the model stopped early).

    Values are decoded from the opening tag on, so a closing tag inside a JSON string does not end the block;
    only when that fails is the block cut at the first closing tag, so a broken call cannot swallow the next.
    """
    collector = _Collector(step, "hermes")
    spans = []
    start = text.find(HERMES_OPEN)
    while start != -1:
        body_start = start + len(HERMES_OPEN)
        first_close = text.find(HERMES_CLOSE, body_start)
        try:
            values, index = _read_values(text, body_start, HERMES_CLOSE)
        except _DecodeError:
            index = first_close if first_close != -1 else len(text)
            collector.add_all(text[body_start:index])
        else:
            collector.record(values)
        end = index + len(HERMES_CLOSE) if text.startswith(HERMES_CLOSE, index) else len(text)
        spans.append((start, end))
        start = text.find(HERMES_OPEN, end)
    return collector.finish(_remove_spans(text, spans))


def _parse_llama(text: str, step: int) -> ParsedReply:
    """Everything after <|python_tag|>: JSON calls, or Python code for the code interpreter."""
    collector = _Collector(step, "llama")
    content, _, body = text.partition(PYTHON_TAG)
    for token in LLAMA_END_TOKENS:
        body = body.replace(token, "")
    if body.strip().startswith(("{", "[")) or not body.strip():
        collector.add_all(body)
    else:
        collector.add({"name": "python", "arguments": {"code": body.strip()}})
    return collector.finish(content)


def _parse_json(text: str, step: int) -> ParsedReply:
    """Call-shaped JSON objects anywhere in the text, and lists of them (the list's brackets and commas are no part of
    the reply's content); a broken object that starts like a call is an error."""
    collector = _Collector(step, "json")
    spans = []
    index = 0
    while (match := OPENING_BRACKET.search(text, index)) is not None:
        start = match.start()
        if text[start] == "[":
            found = _call_list(text, start)
            if found is None:
                index = start + 1
                continue
            collector.add(found[0])
            spans.append((start, found[1]))
            index = found[1]
            continue
        try:
            value, end = _decode_at(text, start)
        except _DecodeError as error:
            if not CALL_START.match(text, start):
                index = start + 1
                continue
            collector.error(f"tool call could not be parsed: {error}")
            end = error.end or len(text)
            spans.append((start, end))
            index = end
            continue
        if _is_call(value):
            collector.add(value)
            spans.append((start, end))
            index = end
        else:
            index = start + 1
    if not spans:
        return ParsedReply(content=text.strip())
    return collector.finish(_remove_spans(text, spans))


def _call_list(text: str, start: int) -> tuple[list[object], int] | None:
    """The JSON list at text[start] and its end, where it is a non-empty list of call-shaped objects, else None."""
    try:
        value, end = _decode_at(text, start)
    except _DecodeError:
        return None
    if isinstance(value, list) and value and all(_is_call(item) for item in value):
        return value, end
    return None


def _decode_at(text: str, start: int) -> tuple[object, int]:
    """The JSON value at text[start] and its end; Python-literal dicts (single quotes, True) pass too."""
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as error:
        json_error = error
    except (ValueError, RecursionError) as error:  # JSON, but more than Python decodes
        raise _DecodeError(f"invalid JSON ({_too_large(error)})", _balanced_end(text, start)) from None
    end = _balanced_end(text, start)
    if end is None:
        raise _DecodeError("the JSON is cut off (the reply probably hit its token limit)", None)
    try:  # only what JSON holds: bytes, sets or complex numbers would pass as a call the trace cannot write
        return json.loads(json.dumps(ast.literal_eval(text[start:end]), allow_nan=False)), end
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _DecodeError(f"invalid JSON ({json_error.msg} at character {json_error.pos - start})", end) from None


def _balanced_end(text: str, start: int) -> int | None:
    """The index just past the bracket that closes text[start], skipping strings; None if it never closes."""
    depth = 0
    quote = None
    escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if quote is not None:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _call_parts(item: object) -> tuple[str, dict[str, Any]]:
    """The name and arguments of one decoded call; also OpenAI-style {"function": ...}, string arguments."""
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]
    if not isinstance(item, dict):
        raise ValueError("a tool call must be a JSON object with a name and arguments")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('a tool call needs a "name" string')
    arguments = item.get("arguments", item.get("parameters"))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of {name} are a string, not a JSON object") from None
        except (ValueError, RecursionError) as error:
            raise ValueError(f"the arguments of {name} are not valid JSON ({_too_large(error)})") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name} must be a JSON object")
    try:  # json.loads takes NaN and Infinity; the JSONL trace then held lines no parser reads
        json.dumps(arguments, allow_nan=False)
        return _valid_strings(name), _valid_strings(arguments)
    except ValueError:
        raise ValueError(f"the arguments of {name} hold NaN or Infinity, which are not JSON numbers") from None
    except RecursionError:  # decoded, but deeper than the walks over it reach
        raise ValueError(f"the arguments of {name} hold {NESTED_TOO_DEEPLY}") from None


def _too_large(error: ValueError | RecursionError) -> str:
    """Why JSON that is well-formed did not decode, for the model: Python's int takes at most 4300 digits from
    text, and nesting is bounded by the interpreter's stack. Both came out of a run's thread as a traceback that
    ended every run (a model repeating a digit or a bracket until its token limit, say)."""
    if isinstance(error, RecursionError):
        return NESTED_TOO_DEEPLY
    return f"a number of more than {sys.get_int_max_str_digits()} digits"


def _valid_strings(value: Any) -> Any:
    """A decoded value with every string made valid Unicode: JSON's "\\ud800" escape decodes to a lone surrogate,
    which no prompt, trace or file name can encode (it ended every run in a traceback); it stays the escape the
    model wrote, as text."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {_valid_strings(key): _valid_strings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_valid_strings(item) for item in value]
    return value


def _is_call(value: object) -> bool:
    """Whether a decoded object has the shape of a call: a name plus arguments, or a nested function."""
    if not isinstance(value, dict):
        return False
    if isinstance(value.get("function"), dict):
        return _is_call(value["function"])
    return isinstance(value.get("name"), str) and ("arguments" in value or "parameters" in value)


def _read_values(text: str, index: int, closing: str | None) -> tuple[list[object], int]:
    """The JSON values from text[index] up to `closing` or the end, and where reading stopped.

    Values may be separated by whitespace, ',' or ';' and wrapped in a ``` or ```json fence.
    """
    values = []
    index = _skip_separators(text, index)
    while index < len(text) and not (closing and text.startswith(closing, index)):
        if text[index] not in "{[":
            raise _DecodeError(f"expected a JSON object, found {text[index : index + 20]!r}", index)
        value, index = _decode_at(text, index)
        values.append(value)
        index = _skip_separators(text, index)
    return values, index


def _skip_separators(text: str, index: int) -> int:
    """The index of the next character that is not a separator or a code fence."""
    while index < len(text):
        if text[index].isspace() or text[index] in ",;":
            index += 1
        elif text.startswith("```", index):
            index += 7 if text.startswith("```json", index) else 3
        else:
            break
    return index


def _remove_spans(text: str, spans: list[tuple[int, int]]) -> str:
    kept, last = [], 0
    for start, end in sorted(spans):
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    return "".join(kept)


def template_renders_tools(chat_template: str) -> bool:
    """Whether a Jinja chat template renders `tools` and assistant `tool_calls` itself (Qwen, Llama 3.1)."""
    return "tools" in chat_template and "tool_calls" in chat_template


def tools_system_prompt(system_prompt: str, schemas: list[dict[str, Any]]) -> str:
    """The system prompt with the tools spelled out, for templates that ignore `tools=` (SmolLM2's ChatML).

    The wording follows the function-calling prompt SmolLM2 was trained with.
    """
    listing = "\n".join(json.dumps(schema["function"], ensure_ascii=False) for schema in schemas)
    return (
        f"{system_prompt}\n\n"
        f"You have access to the following tools:\n<tools>\n{listing}\n</tools>\n"
        "To call tools, reply with a JSON list of calls inside <tool_call></tool_call> tags, like this:\n"
        '<tool_call>[{"name": "func_name", "arguments": {"argument1": "value1"}}]</tool_call>\n'
        "Tool results come back inside <tool_response></tool_response> tags."
    )


def assistant_message(reply: str, parsed: ParsedReply, structured: bool) -> dict[str, Any]:
    """The assistant turn for the history: `tool_calls` for templates that render them, else the raw reply."""
    if not structured or not parsed.calls:
        return {"role": "assistant", "content": reply}
    calls = [call.as_message_part() for call in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}


def tool_message(call: ToolCall, result: ToolResult, structured: bool) -> dict[str, Any]:
    """A tool result as a message: role "tool" where the template renders it, else a <tool_response> turn."""
    text = result_text(result)
    if structured:
        return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}
    return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}


def feedback_message(lines: list[str]) -> dict[str, Any]:
    """Parse errors or a nudge for the model, as a user turn (every template takes one after an assistant)."""
    return {"role": "user", "content": "\n".join(lines)}


def result_text(result: ToolResult) -> str:
    """What the model reads of a result: the content, or the error followed by any output."""
    if result.ok:
        return result.content
    return f"Error: {result.error}" + (f"\n{result.content}" if result.content else "")
