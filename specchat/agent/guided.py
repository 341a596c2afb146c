"""Guided tool calls: the runner writes a call's JSON structure, the model fills in the tool name and the values.

For models too small to start a tool call on their own (SmolLM2-135M answers from memory instead), a turn can be
generated in pieces: the opener `<tool_call>[{"name": "` is given and the model writes the tool name up to its
closing quote; then the key of each required argument is given and the model writes the value up to its closing
quote (for a number or boolean, up to the next `,` or `}`; for an array or object, whose opening bracket is given,
up to the closing bracket that makes it whole); then the call is closed. Each piece is an ordinary
engine request, speculation included, and every piece repeats the conversation so far, which the prefix cache
then serves instead of recomputing it. The structure is constrained by construction, not by masking logits: a name
that is no tool's still comes through, and is answered like any unknown tool.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from specchat.config import SamplingParams
from specchat.engine.sequence import Finished

OPENER = '<tool_call>[{"name": "'  # the list form that tools_system_prompt teaches
CLOSER = "}}]</tool_call>"
NAME_TOKENS = 16  # longest tool name, in tokens, that a guided call waits for
MAX_PIECES = 8  # pieces of one value: a string's that stop at a \" it escapes, an array's or object's that stop at
# a nested (or quoted) closing bracket; then the value is cut there
BRACKETS = {"array": ("[", "]"), "object": ("{", "}")}

Request = Callable[[list[int], SamplingParams], Finished]  # one engine request: prompt ids + sampling -> its end


def guided_call(
    prompt_ids: list[int],
    encode: Callable[[str], list[int]],
    schemas: list[dict[str, Any]],
    sampling: SamplingParams,
    request: Request,
) -> tuple[str, list[Finished]]:
    """The text of one guided call and the requests that wrote it; it ends early when a request did not finish."""
    parameters = {schema["function"]["name"]: schema["function"]["parameters"] for schema in schemas}
    pieces: list[Finished] = []
    text = OPENER

    def fill(stop: list[str], max_tokens: int) -> str | None:
        """What the model writes after `text` up to a stop string; None when the request was cut short."""
        finished = request(prompt_ids + encode(text), replace(sampling, stop=stop, max_tokens=max_tokens))
        pieces.append(finished)
        return finished.text if finished.reason in ("stop", "length") else None

    name = fill(['"'], NAME_TOKENS)
    if name is None:
        return text, pieces
    text += f'{name}", "arguments": {{'
    schema = parameters.get(name, {})
    for index, key in enumerate(schema.get("required", [])):
        kind = schema.get("properties", {}).get(key, {}).get("type", "string")
        text += (", " if index else "") + json.dumps(key) + ": "
        if kind in BRACKETS:  # the runner opens it; the model writes up to a closing bracket, until the value is whole
            opener, closer = BRACKETS[kind]
            text += opener
            value = opener
            for _ in range(MAX_PIECES):
                piece = fill([closer], sampling.max_tokens)
                if piece is None:
                    return text, pieces
                text += piece + closer
                value += piece + closer
                if _is_whole(value):
                    break
            continue
        is_string = kind == "string"
        text += '"' if is_string else ""
        for _ in range(MAX_PIECES if is_string else 1):
            value = fill(['"'] if is_string else [",", "}"], sampling.max_tokens)
            if value is None:
                return text, pieces
            text += value + ('"' if is_string else "")
            if not _escapes_its_quote(value):
                break
    return text + CLOSER, pieces


def _is_whole(value: str) -> bool:
    """Whether an array or object value has closed every bracket it opened outside its strings: a nested closing
    bracket, or one inside a string, is where a piece stopped, not where the value ends."""
    depth, in_string, escaped = 0, False, False
    for char in value:
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
    return depth <= 0


def _escapes_its_quote(value: str) -> bool:
    """Whether a string value stopped at a quote that it escapes itself (an odd run of trailing backslashes)."""
    return (len(value) - len(value.rstrip("\\"))) % 2 == 1
