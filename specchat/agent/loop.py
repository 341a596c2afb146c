"""One run's loop: generate a turn, run the calls in it, send the results back, until an answer or a limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specchat.agent.guided import guided_call
from specchat.agent.script import StopCondition
from specchat.agent.toolcalls import (
    FORMAT_HINTS,
    assistant_message,
    feedback_message,
    parse_tool_calls,
    tool_message,
)
from specchat.agent.tools import FINAL_ANSWER, Toolbox
from specchat.agent.trace import Delta, Error, Event, Final, RunEnd, RunStart, Step, ToolCallEvent, ToolResultEvent
from specchat.config import SamplingParams
from specchat.engine.api import weights_label
from specchat.engine.sequence import Finished, TextDelta
from specchat.engine.stats import SpecStats
from specchat.errors import SpecchatError

if TYPE_CHECKING:
    from specchat.agent.runner import AgentSession

EventSink = Callable[[Event], None]


@dataclass(slots=True)
class RunOutcome:
    """How one run ended, with its transcript: the chat messages it sent, and its last reply."""

    run: int
    reason: str  # as RunEnd.reason
    answer: str | None
    steps: int
    tokens: int  # completion tokens over the run's turns
    prompt_tokens: int  # prompt tokens over the run's turns (each turn resubmits the conversation)
    messages: list[dict[str, Any]]
    stats: SpecStats  # speculation totals over the run's turns


@dataclass(slots=True)
class Turn:
    """One model turn: its text and the engine requests that wrote it (one, or several for a guided call)."""

    text: str
    pieces: list[Finished] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """The engine's finish reason: an error or cancellation of any piece, else the last piece's."""
        reasons = [piece.reason for piece in self.pieces]
        return next((reason for reason in ("error", "cancelled") if reason in reasons), reasons[-1])

    @property
    def error(self) -> str | None:
        return next((piece.error for piece in self.pieces if piece.error), None)

    @property
    def tokens(self) -> int:
        return sum(len(piece.token_ids) for piece in self.pieces)

    def stats(self) -> SpecStats:
        """The speculation stats of the turn's requests, together."""
        stats = SpecStats()
        for piece in self.pieces:
            stats.merge(piece.stats)
        return stats


def merged_stats_json(stats: SpecStats) -> dict:
    """Stats merged over requests (a turn's, a run's, a session's) as JSON, without the recent_* rates: a merge
    keeps no recent steps, so they read 0.0 beside totals of 0.525 and 2.33, and over requests in flight together
    there is no one "now"."""
    return {key: value for key, value in stats.to_json().items() if not key.startswith("recent_")}


def nudge_text(stop: StopCondition, structured: bool) -> str:
    """What a reply with no tool call and no answer gets back."""
    finish = {
        "tool": f"call {FINAL_ANSWER} with the answer",
        "tag": f"write the answer as <{stop.value}>the answer</{stop.value}>",
        "regex": "state the answer",
    }[stop.kind]
    hint = "" if structured else f" Write a tool call as {FORMAT_HINTS['hermes']}"
    return f"Your reply has no tool call. Call a tool, or {finish}.{hint}"


class AgentRun:
    """One task's loop on the session's engine; every step is reported as events."""

    def __init__(self, session: AgentSession, index: int, toolbox: Toolbox | None, emit: EventSink) -> None:
        self.session = session
        self.script = session.script
        self.index = index
        self.toolbox = toolbox
        self.emit = emit
        self.messages = session.first_messages(self.script.tasks[index])
        self.stats = SpecStats()
        self.step = 0
        self.tokens = 0
        self.prompt_tokens = 0
        self.decode_s = 0.0
        self.started = time.perf_counter()
        self.deadline = self.started + self.script.max_wall_s

    def run(self) -> RunOutcome:
        """Run the loop to its end and report it."""
        self._start()
        return self._end(*self._loop())

    def fail(self, message: str) -> RunOutcome:
        """End the run before its first turn with a fatal error (its workspace could not be made, say)."""
        self._start()
        self.emit(Error(self.index, self.step, message, fatal=True))
        return self._end("error", None)

    def _start(self) -> None:
        spec = self.session.spec
        tools = [schema["function"]["name"] for schema in self.session.schemas]
        task = self.script.tasks[self.index]
        memory = self.session.engine.memory()
        weights, kv = weights_label(memory), memory.get("kv_format", "n/a")
        self.emit(
            RunStart(
                self.index, task, self.script.model, spec.drafter, spec.k, tools, self.script.max_steps, weights, kv
            )
        )

    def _end(self, reason: str, answer: str | None) -> RunOutcome:
        stats = {**merged_stats_json(self.stats), **self._throughput()}
        elapsed = round(time.perf_counter() - self.started, 3)
        self.emit(RunEnd(self.index, reason, self.step, self.tokens, elapsed, answer, stats))
        outcome = (self.index, reason, answer, self.step, self.tokens, self.prompt_tokens)
        return RunOutcome(*outcome, self.messages, self.stats)

    def _loop(self) -> tuple[str, str | None]:
        """(reason, answer) at the end of the loop."""
        while self.step < self.script.max_steps:
            if (limit := self._stopped()) is not None:
                return limit, None
            self.step += 1
            try:
                turn = self._generate()
            except SpecchatError as error:  # e.g. the conversation outgrew the context
                self.emit(Error(self.index, self.step, str(error), fatal=True))
                return "error", None
            if turn.reason == "error":
                self.emit(Error(self.index, self.step, turn.error or "the engine failed", fatal=True))
                return "error", None
            if turn.reason == "cancelled":
                return ("cancelled" if self.session.cancelled.is_set() else "max_wall_s"), None
            answer = self._act(turn.text)
            if answer is not None:
                return "final", answer
        return self._stopped() or "max_steps", None  # a last step's calls cut short by a stop or the wall time

    def _stopped(self) -> str | None:
        """'cancelled' once the runs were stopped, 'max_wall_s' once the run's wall time is up, else None."""
        if self.session.cancelled.is_set():
            return "cancelled"
        if time.perf_counter() >= self.deadline:
            return "max_wall_s"
        return None

    def _guided(self) -> bool:
        """Whether this turn is written as a guided call (tool_choice "required", or "first" on step 1)."""
        choice = self.script.tool_choice
        return choice == "required" or (choice == "first" and self.step == 1)

    def _generate(self) -> Turn:
        """One model turn from the history, as one request or as a guided call's pieces."""
        session = self.session
        tools = session.schemas if session.structured and session.schemas else None
        prompt_ids = session.engine.encode_prompt(self.messages, tools=tools)
        if self._guided():
            encode = session.engine.tokenizer.encode
            text, pieces = guided_call(
                prompt_ids,
                lambda text: encode(text, add_special_tokens=False),
                session.schemas,
                self.script.sampling,
                self._request,
            )
            turn = Turn(text, pieces)
        else:
            finished = self._request(prompt_ids, self.script.sampling)
            turn = Turn(finished.text, [finished])
        stats = turn.stats()
        self.stats.merge(stats)
        self.tokens += turn.tokens
        self.prompt_tokens += sum(piece.prompt_tokens for piece in turn.pieces)
        self.decode_s += sum(piece.decode_s for piece in turn.pieces)
        prompt_tokens = turn.pieces[0].prompt_tokens
        step_stats = {**merged_stats_json(stats), "prompt_tokens": prompt_tokens, "requests": len(turn.pieces)}
        elapsed = round(time.perf_counter() - self.started, 3)
        self.emit(Step(self.index, self.step, turn.text, turn.tokens, turn.reason, elapsed, step_stats))
        return turn

    def _request(self, prompt_ids: list[int], sampling: SamplingParams) -> Finished:
        """One engine request, cancelled in the engine when the run's wall time is up."""
        session = self.session
        handle = session.engine.submit(prompt_ids, sampling, session.spec)
        session.track(handle)
        timer = threading.Timer(max(0.0, self.deadline - time.perf_counter()), handle.cancel)
        timer.daemon = True
        timer.start()
        try:
            for event in handle.events():
                if session.stream and isinstance(event, TextDelta) and event.text:
                    self.emit(Delta(self.index, self.step, event.text))
        finally:
            timer.cancel()
            session.untrack(handle)
        return handle.finished

    def _act(self, reply: str) -> str | None:
        """Act on one reply: run its calls and queue what goes back; returns the answer when the run is done."""
        structured = self.session.structured
        parsed = parse_tool_calls(reply, self.step)
        self.messages.append(assistant_message(reply, parsed, structured))
        for message in parsed.errors:
            self.emit(Error(self.index, self.step, message))
        for position, call in enumerate(parsed.calls):
            # past the wall time, the reply's later calls are not started (the one before has finished); its first
            # call runs, as a reply that ended in time is acted on, and so does a final answer, which runs nothing
            if position and call.name != FINAL_ANSWER and self._stopped() is not None:
                return None
            self.emit(ToolCallEvent(self.index, self.step, call.id, call.name, call.arguments))
            result = self.toolbox.call(call.name, call.arguments)
            self.emit(
                ToolResultEvent(self.index, self.step, call.id, call.name, result.ok, result.content, result.error)
            )
            if call.name == FINAL_ANSWER and result.ok:
                self.emit(Final(self.index, self.step, result.content, FINAL_ANSWER))
                return result.content
            self._append(tool_message(call, result, structured))
        feedback = list(parsed.errors)
        if not parsed.calls:
            answer = self.script.stop.answer_in(parsed.content)
            if answer:  # an empty one (`<final> </final>`) is nudged, as final_answer refuses it
                self.emit(Final(self.index, self.step, answer, self.script.stop.kind))
                return answer
            if not parsed.errors:
                feedback.append(nudge_text(self.script.stop, structured))
        if feedback:
            self._append(feedback_message(feedback))
        return None

    def _append(self, message: dict[str, Any]) -> None:
        """Add a message; a user turn right after a user turn joins it (some templates insist on alternation)."""
        last = self.messages[-1]
        if message["role"] == "user" and last["role"] == "user":
            last["content"] = f"{last['content']}\n{message['content']}"
        else:
            self.messages.append(message)

    def _throughput(self) -> dict[str, Any]:
        """Prompt and completion tokens of the run, and completion tokens per second of decoding."""
        tok_per_s = self.tokens / self.decode_s if self.decode_s > 0 else 0.0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens, "tok_per_s": round(tok_per_s, 3)}
