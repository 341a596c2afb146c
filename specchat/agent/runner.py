"""The agent loop on the engine: one run per task, up to `concurrency` runs in flight, every step a trace event.

    session = AgentSession(engine, load_script("examples/agents/arithmetic.toml"))
    outcomes = session.run(TracePrinter(sys.stdout).write)     # blocking; or, for a live view:
    for event in session.events(): ...                          # the same events, from a worker thread

Runs are threads that each wait on their own request; the engine batches every running request into one
forward per step, whether its loop runs in the background (`engine.start()`) or is driven by the waiting
threads themselves. A run's wall-time limit cancels its request in the engine, so it ends mid-turn.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specchat.agent.sandbox import run_workspace
from specchat.agent.script import AgentScript, StopCondition
from specchat.agent.toolcalls import (
    FORMAT_HINTS,
    assistant_message,
    feedback_message,
    parse_tool_calls,
    template_renders_tools,
    tool_message,
    tools_system_prompt,
)
from specchat.agent.tools import FINAL_ANSWER, ConfirmFn, Toolbox, build_toolbox
from specchat.agent.trace import (
    Delta,
    Error,
    Event,
    Final,
    RunEnd,
    RunStart,
    SessionEnd,
    Step,
    ToolCallEvent,
    ToolResultEvent,
)
from specchat.config import SpecParams
from specchat.engine.sequence import Finished, TextDelta
from specchat.engine.stats import SpecStats
from specchat.errors import ConfigError, SpecchatError

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


def usable_spec(engine, spec: SpecParams) -> tuple[SpecParams, str | None]:
    """The script's speculation, or plain decoding plus a one-line warning when the engine lacks its drafter."""
    try:
        engine.drafter(spec.drafter)
    except SpecchatError as error:
        warning = f"drafter {spec.drafter!r} is not available here ({error}); running without speculation"
        return replace(spec, drafter="none"), warning
    return spec, None


def prefix_hit_tokens(engine) -> int | None:
    """Prompt tokens the engine has taken from its prefix cache so far; None when it does not say."""
    return engine.memory().get("kv_prefix_hit_tokens")


def session_end(outcomes: list[RunOutcome], elapsed_s: float, hit_tokens: int | None) -> SessionEnd:
    """The summary of a finished session: reasons, throughput, speculation and prefix-cache hits."""
    stats = SpecStats()
    for outcome in outcomes:
        stats.merge(outcome.stats)
    tokens = sum(outcome.tokens for outcome in outcomes)
    prompt_tokens = sum(outcome.prompt_tokens for outcome in outcomes)
    hit_rate = None if hit_tokens is None or not prompt_tokens else round(hit_tokens / prompt_tokens, 4)
    return SessionEnd(
        runs=len(outcomes),
        reasons=dict(Counter(outcome.reason for outcome in outcomes)),
        elapsed_s=round(elapsed_s, 3),
        tokens=tokens,
        tok_per_s=round(tokens / elapsed_s, 3) if elapsed_s > 0 else 0.0,
        prefix_hit_rate=hit_rate,
        stats={**stats.to_json(), "prompt_tokens": prompt_tokens},
    )


def nudge_text(stop: StopCondition, structured: bool) -> str:
    """What a reply with no tool call and no answer gets back."""
    finish = {
        "tool": f"call {FINAL_ANSWER} with the answer",
        "tag": f"write the answer as <{stop.value}>the answer</{stop.value}>",
        "regex": "state the answer",
    }[stop.kind]
    hint = "" if structured else f" Write a tool call as {FORMAT_HINTS['hermes']}"
    return f"Your reply has no tool call. Call a tool, or {finish}.{hint}"


class AgentSession:
    """Every run of one script on one engine, and the settings they share."""

    def __init__(
        self,
        engine,
        script: AgentScript,
        concurrency: int | None = None,
        confirm: ConfirmFn | None = None,
        stream: bool = False,
    ) -> None:
        self.engine = engine
        self.script = script
        self.concurrency = script.concurrency if concurrency is None else concurrency
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        self.confirm = confirm
        self.stream = stream  # emit Delta events as replies are generated (live views)
        self.spec, self.warning = usable_spec(engine, script.speculation)
        self.structured = template_renders_tools(engine.tokenizer.chat_template_source or "")
        self.schemas = build_toolbox(script.tools, script.workspace or Path.cwd(), confirm).schemas()
        self.cancelled = threading.Event()
        self._handles: set = set()
        self._lock = threading.Lock()

    def first_messages(self, task: str) -> list[dict[str, Any]]:
        """The system prompt (with the tools listed when the template does not render them) and the task."""
        system = self.script.system_prompt
        if self.schemas and not self.structured:
            system = tools_system_prompt(system, self.schemas)
        return [{"role": "system", "content": system}, {"role": "user", "content": task}]

    def run(self, on_event: EventSink) -> list[RunOutcome]:
        """Run every task, blocking; `on_event` gets each event, from one thread at a time, in order per run."""
        lock = threading.Lock()

        def emit(event: Event) -> None:
            with lock:
                on_event(event)

        started, hits_before = time.perf_counter(), prefix_hit_tokens(self.engine)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="specchat-agent") as pool:
            futures = [pool.submit(self._run_one, index, emit) for index in range(len(self.script.tasks))]
            try:
                outcomes = [future.result() for future in futures]
            except BaseException:
                self.cancel()
                raise
        hits_after = prefix_hit_tokens(self.engine)
        hits = None if hits_before is None or hits_after is None else hits_after - hits_before
        emit(session_end(outcomes, time.perf_counter() - started, hits))
        return outcomes

    def events(self) -> Iterator[Event]:
        """Run every task on a worker thread and yield its events as they happen; errors re-raise here."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        done = object()
        failure: list[BaseException] = []

        def work() -> None:
            try:
                self.run(events.put)
            except BaseException as error:
                failure.append(error)
            finally:
                events.put(done)

        threading.Thread(target=work, name="specchat-agent-session", daemon=True).start()
        drained = False
        try:
            while (event := events.get()) is not done:
                yield event
            drained = True
        finally:
            if not drained:  # the consumer stopped early: stop the runs too
                self.cancel()
        if failure:
            raise failure[0]

    def cancel(self) -> None:
        """End every run: requests in flight are cancelled in the engine, and no run starts another turn."""
        with self._lock:
            self.cancelled.set()
            handles = list(self._handles)
        for handle in handles:
            handle.cancel()

    def track(self, handle) -> None:
        """Remember a request in flight so that cancel() reaches it (at once if already cancelled)."""
        with self._lock:
            self._handles.add(handle)
            cancelled = self.cancelled.is_set()
        if cancelled:
            handle.cancel()

    def untrack(self, handle) -> None:
        with self._lock:
            self._handles.discard(handle)

    def _run_one(self, index: int, emit: EventSink) -> RunOutcome:
        with run_workspace(self.script.workspace, self.script.copy_workspace) as workspace:
            toolbox = build_toolbox(self.script.tools, workspace, self.confirm)
            return AgentRun(self, index, toolbox, emit).run()


class AgentRun:
    """One task's loop: generate a turn, run its calls, feed the results back, until an answer or a limit."""

    def __init__(self, session: AgentSession, index: int, toolbox: Toolbox, emit: EventSink) -> None:
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
        spec = self.session.spec
        self.emit(
            RunStart(
                run=self.index,
                task=self.script.tasks[self.index],
                model=self.script.model,
                drafter=spec.drafter,
                k=spec.k,
                tools=[schema["function"]["name"] for schema in self.session.schemas],
                max_steps=self.script.max_steps,
            )
        )
        reason, answer = self._loop()
        stats = {**self.stats.to_json(), **self._throughput()}
        elapsed = time.perf_counter() - self.started
        self.emit(RunEnd(self.index, reason, self.step, self.tokens, round(elapsed, 3), answer, stats))
        return RunOutcome(
            self.index, reason, answer, self.step, self.tokens, self.prompt_tokens, self.messages, self.stats
        )

    def _loop(self) -> tuple[str, str | None]:
        """(reason, answer) at the end of the loop."""
        while self.step < self.script.max_steps:
            if self.session.cancelled.is_set():
                return "cancelled", None
            if time.perf_counter() >= self.deadline:
                return "max_wall_s", None
            self.step += 1
            try:
                finished = self._generate()
            except SpecchatError as error:  # e.g. the conversation outgrew the context
                self.emit(Error(self.index, self.step, str(error), fatal=True))
                return "error", None
            if finished.reason == "error":
                self.emit(Error(self.index, self.step, finished.error or "the engine failed", fatal=True))
                return "error", None
            if finished.reason == "cancelled":
                return ("cancelled" if self.session.cancelled.is_set() else "max_wall_s"), None
            answer = self._act(finished.text)
            if answer is not None:
                return "final", answer
        return "max_steps", None

    def _generate(self) -> Finished:
        """One model turn from the history, cancelled in the engine when the run's wall time is up."""
        session = self.session
        tools = session.schemas if session.structured and session.schemas else None
        handle = session.engine.submit(self.messages, self.script.sampling, session.spec, tools=tools)
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
        finished = handle.finished
        self.stats.merge(finished.stats)
        self.tokens += len(finished.token_ids)
        self.prompt_tokens += finished.prompt_tokens
        self.decode_s += finished.decode_s
        step_stats = {**finished.stats.to_json(), "prompt_tokens": finished.prompt_tokens}
        elapsed = round(time.perf_counter() - self.started, 3)
        step = Step(self.index, self.step, finished.text, len(finished.token_ids), finished.reason, elapsed, step_stats)
        self.emit(step)
        return finished

    def _act(self, reply: str) -> str | None:
        """Act on one reply: run its calls and queue what goes back; returns the answer when the run is done."""
        structured = self.session.structured
        parsed = parse_tool_calls(reply, self.step)
        self.messages.append(assistant_message(reply, parsed, structured))
        for message in parsed.errors:
            self.emit(Error(self.index, self.step, message))
        for call in parsed.calls:
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
            if answer is not None:
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
