"""The events an agent run emits, a JSONL writer (one object per line) and a readable headless printer.

Every event names its run (the index of its task) so concurrent runs can share one stream. `stats` fields hold
`SpecStats.to_json()` of the engine (steps, drafted, accepted, acceptance_rate, tokens_per_step, ...).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

from specchat.agent.isolation import detect_isolation

PROCESS_TOOLS = ("python", "shell")


@dataclass(slots=True)
class RunStart:
    """A run begins: its task and the settings it runs with."""

    type: str = field(default="run_start", init=False)
    run: int
    task: str
    model: str
    drafter: str
    k: int | None  # None: adaptive
    tools: list[str]
    max_steps: int
    weights: str = "n/a"  # the engine's weights as the run starts: "float32", "mxfp4 (gptq-rot (cached))", ...
    kv: str = "n/a"  # the engine's KV page format as the run starts
    sandbox: str = field(default_factory=lambda: detect_isolation().describe())  # what confines python, shell


@dataclass(slots=True)
class Step:
    """One model turn finished: its text, and the engine's speculation stats for that turn."""

    type: str = field(default="step", init=False)
    run: int
    step: int
    text: str
    tokens: int  # tokens generated in this turn
    finish_reason: str  # the engine's: "eos", "stop", "max_tokens", ...
    elapsed_s: float  # since the run started
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Delta:
    """New text of the turn being generated; only sessions that stream emit it (for live views)."""

    type: str = field(default="delta", init=False)
    run: int
    step: int
    text: str


@dataclass(slots=True)
class ToolCallEvent:
    """The model asked for a tool."""

    type: str = field(default="tool_call", init=False)
    run: int
    step: int
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class ToolResultEvent:
    """A tool answered (or failed)."""

    type: str = field(default="tool_result", init=False)
    run: int
    step: int
    id: str
    name: str
    ok: bool
    content: str
    error: str | None = None


@dataclass(slots=True)
class Final:
    """The run has its answer; `source` is how it was found: "final_answer", "tag" or "regex"."""

    type: str = field(default="final", init=False)
    run: int
    step: int
    answer: str
    source: str


@dataclass(slots=True)
class Error:
    """Something went wrong; `fatal` ends the run, else (a malformed call, say) it goes back to the model."""

    type: str = field(default="error", init=False)
    run: int
    step: int
    message: str
    fatal: bool = False


@dataclass(slots=True)
class RunEnd:
    """A run is over: why, after how many steps and how long, with its speculation totals."""

    type: str = field(default="run_end", init=False)
    run: int
    reason: str  # "final", "max_steps", "max_wall_s", "error" or "cancelled"
    steps: int
    tokens: int
    elapsed_s: float
    answer: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SessionEnd:
    """Every run of a session is over: how they ended, the whole workload's throughput and speculation.

    `prefix_hit_rate` is the share of prompt tokens the engine took from its prefix cache instead of computing
    them, over every turn of every run; None when the engine does not report prefix-cache hits.
    """

    type: str = field(default="session_end", init=False)
    runs: int
    reasons: dict[str, int]  # RunEnd.reason -> runs
    elapsed_s: float
    tokens: int  # completion tokens of every turn of every run
    tok_per_s: float  # tokens / elapsed_s: the workload's throughput
    prefix_hit_rate: float | None
    stats: dict[str, Any] = field(default_factory=dict)


Event = RunStart | Step | Delta | ToolCallEvent | ToolResultEvent | Final | Error | RunEnd | SessionEnd


def event_dict(event: Event) -> dict[str, Any]:
    """An event as a plain dict with `type` first."""
    return dataclasses.asdict(event)


def writes_utf8(stream: TextIO) -> bool:
    """Whether a text stream encodes every character (UTF-8, or no encoding: a StringIO); with
    PYTHONIOENCODING=ascii or a latin-1 locale, stdout raised UnicodeEncodeError at the first other character."""
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return True
    try:
        return codecs.lookup(encoding).name in ("utf-8", "utf-8-sig", "utf-16", "utf-32")
    except LookupError:
        return False


class JsonlWriter:
    """Writes each event as one JSON object per line; safe to share between runs on several threads."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.ascii = not writes_utf8(stream)  # JSON's \u escapes where the stream cannot hold every character

    def write(self, event: Event) -> None:
        """Append one event and flush, so a crash loses at most the line being written."""
        line = json.dumps(event_dict(event), ensure_ascii=self.ascii)
        with self.lock:
            self.stream.write(line + "\n")
            self.stream.flush()


# control characters as visible escapes (newlines and tabs kept): a tool's output or the model's text holding
# "\x1b[2J" or an OSC title string cleared or retitled the user's terminal
CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if chr(c) not in "\n\t"}


class TracePrinter:
    """Prints events as a compact plain-text trace: one line per event, model text indented under its step."""

    def __init__(self, stream: TextIO, width: int = 100, max_lines: int = 8) -> None:
        self.stream = stream
        self.width = width
        self.max_lines = max_lines
        self.lock = threading.Lock()
        self.encoding = None if writes_utf8(stream) else stream.encoding

    def write(self, event: Event) -> None:
        """Print one event."""
        lines = self.format(event)
        if not lines:
            return
        text = "\n".join(lines).translate(CONTROL_ESCAPES) + "\n"
        if self.encoding is not None:  # characters the stream cannot hold as escapes (\u65e5), not an error
            text = text.encode(self.encoding, "backslashreplace").decode(self.encoding)
        with self.lock:
            self.stream.write(text)
            self.stream.flush()

    def format(self, event: Event) -> list[str]:
        """The lines that show one event."""
        if isinstance(event, SessionEnd):
            return [f"[all] {session_summary(event)}"]
        tag = f"[run {event.run}]"
        match event:
            case RunStart():
                k = "auto" if event.k is None else event.k
                drafter = event.drafter if event.drafter == "none" else f"{event.drafter} k={k}"  # no drafter, no k
                tools = ", ".join(event.tools) or "none"
                settings = f"model {event.model}, weights {event.weights}, KV {event.kv}, drafter {drafter}"
                limits = f"tools {tools}, max {plural(event.max_steps, 'step')}"
                header = [self._clip(f"{tag} task: {event.task}"), f"{tag}   {settings}", f"{tag}   {limits}"]
                if any(name in PROCESS_TOOLS for name in event.tools):
                    header.append(f"{tag}   sandbox: {event.sandbox}")
                return header
            case Step():
                head = f"{tag} step {event.step}: {plural(event.tokens, 'token')}{_stats_text(event.stats)}"
                return [head, *self._block(event.text)]
            case Delta():
                return []  # the whole reply is shown with its step
            case ToolCallEvent():
                arguments = json.dumps(event.arguments, ensure_ascii=False)
                return [self._clip(f"{tag}   -> {event.name}({arguments})")]
            case ToolResultEvent():
                status = "ok" if event.ok else f"error: {event.error}"
                return [self._clip(f"{tag}   <- {event.name} {status}"), *self._block(event.content)]
            case Final():
                head = f"{tag} => final answer ({event.source})"
                if "\n" in event.answer.strip():
                    return [head + ":", *self._block(event.answer)]
                return [self._clip(f"{head}: {event.answer.strip()}")]
            case Error():
                return [self._clip(f"{tag} !! {'fatal: ' if event.fatal else ''}{event.message}")]
            case RunEnd():
                return [
                    f"{tag} end: {event.reason} after {plural(event.steps, 'step')}, {plural(event.tokens, 'token')}, "
                    f"{event.elapsed_s:.1f} s{_stats_text(event.stats)}"
                ]
        raise TypeError(f"not an agent event: {event!r}")

    def _block(self, text: str) -> list[str]:
        """Text indented under its event, cut to max_lines lines of at most `width` characters."""
        lines = text.strip().splitlines() or ["(empty)"]
        shown = [self._clip("      | " + line) for line in lines[: self.max_lines]]
        if len(lines) > self.max_lines:
            shown.append(f"      | ... {len(lines) - self.max_lines} more lines")
        return shown

    def _clip(self, line: str) -> str:
        """One line, newlines flattened, cut to `width` characters."""
        line = line.replace("\n", " ")
        return line if len(line) <= self.width else line[: self.width - 3] + "..."


def plural(count: int, noun: str) -> str:
    """'1 run', '2 runs'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _stats_text(stats: dict[str, Any]) -> str:
    """', 2.31 tokens/step, 57% accepted, 80% prefix-cache hits' for what the stats hold."""
    parts = []
    if "tokens_per_step" in stats:
        parts.append(f"{stats['tokens_per_step']:.2f} tokens/step")
    if stats.get("drafted"):
        parts.append(f"{stats.get('acceptance_rate', 0.0):.0%} accepted")
    if "prefix_hit_rate" in stats:
        parts.append(f"{stats['prefix_hit_rate']:.0%} prefix-cache hits")
    return "".join(f", {part}" for part in parts)


def session_summary(event: SessionEnd) -> str:
    """'4 runs (3 final, 1 max_steps), 412 tokens in 9.8 s, 42.0 tokens/s, ..., prefix-cache hits 61%'."""
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(event.reasons.items()))
    hits = "n/a" if event.prefix_hit_rate is None else f"{event.prefix_hit_rate:.0%}"
    return (
        f"{plural(event.runs, 'run')} ({reasons}), {plural(event.tokens, 'token')} in {event.elapsed_s:.1f} s, "
        f"{event.tok_per_s:.1f} tokens/s{_stats_text(event.stats)}, prefix-cache hits {hits}"
    )
