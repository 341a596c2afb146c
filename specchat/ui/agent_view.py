"""One agent run on screen: its task, its status and its live trace (each step's streamed text, tool calls with
their arguments, tool results folded to their first lines, the answer or the error), and the two dialogs of the
agent view (may this run execute a shell command? which script to run?)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.suggester import Suggester
from textual.widget import Widget
from textual.widgets import Button, Input, Label, Static

from specchat.agent.trace import (
    Delta,
    Error,
    Event,
    Final,
    RunEnd,
    RunStart,
    Step,
    ToolCallEvent,
    ToolResultEvent,
    plural,
)

RESULT_LINES = 8  # lines of a tool result shown until it is expanded
STATE_MARKS = {"queued": "·", "running": "▶", "final": "✓", "error": "✗", "cancelled": "■"}  # other ends: "…"


def stats_text(stats: dict[str, Any]) -> list[str]:
    """'2.20 tok/step', '57% accepted' for what a step's or run's speculation stats hold."""
    parts = []
    if "tokens_per_step" in stats:
        parts.append(f"{stats['tokens_per_step']:.2f} tok/step")
    if stats.get("drafted"):
        parts.append(f"{stats.get('acceptance_rate', 0.0):.0%} accepted")
    return parts


def arguments_text(arguments: dict[str, Any]) -> str:
    """A call's arguments one per line; multi-line strings (code, file contents) as indented blocks."""
    lines = []
    for name, value in arguments.items():
        if isinstance(value, str) and "\n" in value.strip():
            lines.append(f"{name}:")
            lines.extend(f"  {line}" for line in value.rstrip().splitlines())
        else:
            lines.append(f"{name} = {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines) or "(no arguments)"


class StepView(Widget):
    """One model turn: its number and figures, and its text as it streams in."""

    text: reactive[str] = reactive("", layout=True)
    heading: reactive[str] = reactive("", layout=True)

    def __init__(self, step: int) -> None:
        super().__init__(classes="streaming")
        self.step = step
        self.set_reactive(StepView.heading, f"step {step}")

    def render(self) -> Text:
        return Text.assemble((self.heading, "bold"), "\n", self.text or "…")

    def finish(self, event: Step) -> None:
        """The turn is over: its whole text (it wins over what streamed) and its figures."""
        self.text = event.text
        parts = [f"step {event.step}", f"{event.tokens} tokens", *stats_text(event.stats), event.finish_reason]
        self.heading = " · ".join(parts)
        self.remove_class("streaming")


class ToolCallView(Static):
    """The model asked for a tool: its name and arguments."""

    def __init__(self, event: ToolCallEvent) -> None:
        super().__init__(Text.assemble((f"→ {event.name}", "bold"), "\n", arguments_text(event.arguments)))
        self.event = event


class ToolResultView(Widget, can_focus=True):
    """A tool's answer, folded to its first lines: Enter or a click shows all of it."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "toggle", "Expand", id="toggle_result")]

    expanded: reactive[bool] = reactive(False, layout=True)

    def __init__(self, event: ToolResultEvent) -> None:
        super().__init__(classes="ok" if event.ok else "failed")
        self.event = event
        self.lines = event.content.rstrip().splitlines()

    @property
    def folded(self) -> int:
        """Lines hidden while folded."""
        return max(len(self.lines) - RESULT_LINES, 0)

    def render(self) -> Text:
        event = self.event
        status = "ok" if event.ok else f"error: {event.error}"
        text = Text.assemble((f"← {event.name} {status}", "bold"))
        shown = self.lines if self.expanded else self.lines[:RESULT_LINES]
        if shown or event.ok:
            text.append("\n" + ("\n".join(shown) if shown else "(no output)"))
        if self.folded:
            hint = "Enter folds it" if self.expanded else f"… {self.folded} more lines: Enter or click shows them"
            text.append(f"\n{hint}", "dim")
        return text

    def action_toggle(self) -> None:
        """Show all of the result, or fold it again."""
        self.expanded = not self.expanded

    def on_click(self) -> None:
        self.action_toggle()


class AnswerView(Static):
    """The run's final answer."""

    def __init__(self, event: Final) -> None:
        super().__init__(Text.assemble((f"answer ({event.source})", "bold"), "\n", event.answer.strip()))


class ErrorView(Static):
    """Something went wrong: a malformed call goes back to the model; a fatal error ends the run."""

    def __init__(self, event: Error) -> None:
        super().__init__(
            Text(f"{'fatal: ' if event.fatal else ''}{event.message}"), classes="fatal" if event.fatal else ""
        )


class TraceScroll(VerticalScroll, inherit_bindings=False):
    """The trace's scroll: arrow and page keys scroll it; Ctrl+PageUp/PageDown still switch tabs."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "scroll_up", "Scroll up", show=False),
        Binding("down", "scroll_down", "Scroll down", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        Binding("home", "scroll_home", "Top", show=False),
        Binding("end", "scroll_end", "Bottom", show=False),
    ]


class AgentRunPane(Vertical):
    """One run of an agent script: its task, how far it got, and its trace as it happens."""

    def __init__(self, run: int, task: str) -> None:
        super().__init__(classes="agent-run")
        self.run_index = run
        self.agent_task = task
        self.state = "queued"  # then "running", then RunEnd.reason
        self.status = "queued: waits for a free slot"
        self.answer: str | None = None
        self.step_view: StepView | None = None

    def compose(self):
        yield Static(Text(f"run {self.run_index + 1}: {self.agent_task}"), classes="run-task")
        yield Static(self.status, classes="run-status")
        yield TraceScroll(classes="trace")

    def on_mount(self) -> None:
        self.query_one(".trace", TraceScroll).anchor()

    @property
    def label(self) -> str:
        """The tab's label: a mark for the state, the run's number and the start of its task."""
        task = " ".join(self.agent_task.split())
        task = task if len(task) <= 20 else task[:19] + "…"
        return f"{STATE_MARKS.get(self.state, '…')} {self.run_index + 1}: {task}"

    async def show(self, events: list[Event]) -> None:
        """Add a batch of this run's events to the trace (all the text streamed since the last batch at once)."""
        new: list[Widget] = []
        for event in events:
            match event:
                case RunStart():
                    self.state = "running"
                    k = "auto" if event.k is None else event.k
                    tools = ", ".join(event.tools) or "none"
                    self.status = (
                        f"running · weights {event.weights} · KV {event.kv} · drafter {event.drafter} k={k}"
                        f" · tools {tools} · max {event.max_steps} steps"
                    )
                case Delta():
                    view = self.current_step(event.step, new)
                    view.text += event.text
                case Step():
                    self.current_step(event.step, new).finish(event)
                case ToolCallEvent():
                    new.append(ToolCallView(event))
                case ToolResultEvent():
                    new.append(ToolResultView(event))
                case Error():
                    new.append(ErrorView(event))
                case Final():
                    self.answer = event.answer
                    new.append(AnswerView(event))
                case RunEnd():
                    self.state = event.reason
                    figures = [f"{event.tokens} tokens", f"{event.elapsed_s:.1f} s", *stats_text(event.stats)]
                    self.status = f"{event.reason} after {plural(event.steps, 'step')} · " + " · ".join(figures)
        if new:
            await self.query_one(".trace", TraceScroll).mount_all(new)
        self.query_one(".run-status", Static).update(self.status)

    async def fail(self, problem: str) -> None:
        """The session ended in an exception before this run did: the run ends with it."""
        step = self.step_view.step if self.step_view is not None else 0
        self.state = "error"
        self.status = "error: the agent session failed before this run ended"
        await self.show([Error(self.run_index, step, problem, fatal=True)])

    def current_step(self, step: int, new: list[Widget]) -> StepView:
        """The view of turn `step`, opened (and queued for mounting) when the turn is new."""
        if self.step_view is None or self.step_view.step != step:
            self.step_view = StepView(step)
            new.append(self.step_view)
        return self.step_view


class ShellConfirmScreen(ModalScreen[bool]):
    """May an agent run execute this shell command? y allows; n or Esc refuses (the default)."""

    AUTO_FOCUS = "#refuse"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Allow", id="shell_allow"),
        Binding("n", "answer(False)", "Refuse", id="shell_refuse"),
        Binding("escape", "answer(False)", "Refuse", id="shell_refuse_escape"),
    ]

    def __init__(self, asker: str, command: str) -> None:
        super().__init__()
        self.asker = asker
        self.command = command

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Allow this shell command?", classes="title")
            yield Static(Text(self.asker), classes="asker")
            yield Static(Text(self.command), classes="command")
            with Horizontal(classes="buttons"):
                yield Button("Allow (y)", variant="warning", id="allow")
                yield Button("Refuse (n)", variant="primary", id="refuse")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "allow")

    def action_answer(self, allowed: bool) -> None:
        """Answer the run."""
        self.dismiss(allowed)


class ScriptPaths(Suggester):
    """Completes the path typed: to a whole example script where one starts so, else as a shell does, one level
    at a time (folders and .toml files under the folder typed so far, relative to the working directory unless
    the path is absolute or starts with ~)."""

    def __init__(self, examples: list[str]) -> None:
        super().__init__(use_cache=False, case_sensitive=True)
        self.examples = examples

    async def get_suggestion(self, value: str) -> str | None:
        example = next((path for path in self.examples if path.startswith(value)), None)
        if example is not None:
            return example
        folder_text = value[: value.rfind("/") + 1]  # "examples/ag" -> "examples/"
        stem = value[len(folder_text) :]
        folder = Path(folder_text or ".").expanduser()
        try:
            entries = sorted(folder.iterdir())
        except OSError:
            return None
        for entry in entries:
            if not entry.name.startswith(stem) or (entry.name.startswith(".") and not stem.startswith(".")):
                continue
            if entry.is_dir():
                return f"{folder_text}{entry.name}/"
            if entry.suffix == ".toml":
                return f"{folder_text}{entry.name}"
        return None


class AgentScriptScreen(ModalScreen[Path | None]):
    """Which agent script to run: a path, with the example scripts as suggestions."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="agent_script_close")]

    def __init__(self, suggestions: list[str]) -> None:
        super().__init__()
        self.suggestions = suggestions

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Run an agent script (Enter runs it, → completes, Esc closes)", classes="title")
            placeholder = self.suggestions[0] if self.suggestions else "path/to/script.toml"
            yield Input(placeholder=placeholder, suggester=ScriptPaths(self.suggestions))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Run the script at the path typed."""
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_close(self) -> None:
        """Back to the chats."""
        self.dismiss(None)
