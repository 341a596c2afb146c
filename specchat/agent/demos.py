"""Demonstrations: worked examples a script shows the model before its task, as earlier turns of the chat.

Each is a task, the calls that solve it with their results, and the answer, rendered in the same format as the
run's own turns (tool calls as the template or the tools prompt expects, results as tool messages), so a small
model can copy the pattern. Every run of a script shares them, so the prefix cache holds them once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specchat.agent.toolcalls import HERMES_CLOSE, HERMES_OPEN, ParsedReply, ToolCall, assistant_message, tool_message
from specchat.agent.tools import FINAL_ANSWER, ToolResult

if TYPE_CHECKING:
    from specchat.agent.script import StopCondition


@dataclass(slots=True)
class DemoCall:
    """One call of a demonstration and the result it got."""

    name: str
    arguments: dict[str, Any]
    result: str


@dataclass(slots=True)
class Demo:
    """A worked example: the task, its calls in order, and the answer (for a regex stop: the whole last reply)."""

    task: str
    answer: str
    calls: list[DemoCall] = field(default_factory=list)


def demo_messages(demos: list[Demo], stop: StopCondition, structured: bool) -> list[dict[str, Any]]:
    """The chat turns that show every demonstration, in the run's own format."""
    messages: list[dict[str, Any]] = []
    for demo_index, demo in enumerate(demos):
        messages.append({"role": "user", "content": demo.task})
        calls = (
            [*demo.calls, DemoCall(FINAL_ANSWER, {"answer": demo.answer}, "")] if stop.kind == "tool" else demo.calls
        )
        for call_index, demo_call in enumerate(calls):
            call = ToolCall(f"d{demo_index:04d}{call_index:04d}", demo_call.name, demo_call.arguments)
            messages.append(_call_message(call, structured))
            if demo_call.name != FINAL_ANSWER:
                messages.append(tool_message(call, ToolResult(True, demo_call.result), structured))
        if stop.kind == "tag":
            messages.append({"role": "assistant", "content": f"<{stop.value}>{demo.answer}</{stop.value}>"})
        elif stop.kind == "regex":
            messages.append({"role": "assistant", "content": demo.answer})
    return messages


def empty_answer(answer: str, stop: StopCondition) -> str | None:
    """Why a worked example's answer is empty as the stop condition reads it (a run turns such an answer back:
    final_answer refuses it, the loop nudges an empty tag or match), or None where it is not."""
    if stop.kind == "tool":
        return None if answer.strip() else f"is empty: {FINAL_ANSWER} refuses an empty answer"
    if stop.kind == "tag":
        reply = f"<{stop.value}>{answer}</{stop.value}>"  # the example's last turn (demo_messages)
        return None if stop.answer_in(reply) else f"is empty: <{stop.value}></{stop.value}> ends no run"
    return None if stop.answer_in(answer) else f"leaves stop.regex {stop.value!r} an empty answer, which ends no run"


def _call_message(call: ToolCall, structured: bool) -> dict[str, Any]:
    """An assistant turn making one call: `tool_calls` for templates that render them, else the taught markup."""
    payload = json.dumps([{"name": call.name, "arguments": call.arguments}], ensure_ascii=False)
    reply = f"{HERMES_OPEN}{payload}{HERMES_CLOSE}"
    return assistant_message(reply, ParsedReply(content="", calls=[call], format="hermes"), structured)
