"""The agent loop on the engine: one run per task, up to `concurrency` runs in flight, every step a trace event.

    session = AgentSession(engine, load_script("examples/agents/arithmetic.toml"))
    outcomes = session.run(TracePrinter(sys.stdout).write)     # blocking; or, for a live view:
    for event in session.events(): ...                          # the same events, from a worker thread

Runs are threads that each wait on their own request; the engine batches every running request into one
forward per step, whether its loop runs in the background (`engine.start()`) or is driven by the waiting
threads themselves. A run's wall-time limit cancels its request in the engine, so it ends mid-turn.
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from specchat.agent.demos import demo_messages
from specchat.agent.loop import AgentRun, EventSink, RunOutcome, merged_stats_json
from specchat.agent.sandbox import run_workspace
from specchat.agent.script import AgentScript
from specchat.agent.toolcalls import template_renders_tools, tools_system_prompt
from specchat.agent.tools import ConfirmFn, build_toolbox
from specchat.agent.trace import Event, SessionEnd
from specchat.config import SpecParams
from specchat.engine.api import AgentEngine
from specchat.engine.stats import SpecStats
from specchat.errors import ConfigError, SpecchatError

__all__ = ["AgentSession", "RunOutcome", "session_end", "usable_spec"]

# How often run() wakes while it waits for the runs. A process-directed signal (Ctrl-C, SIGTERM) that the kernel hands
# to one of the runs' threads only flags it for the main thread, which runs Python handlers; blocked on a lock with no
# timeout, the main thread then never saw it until a run ended (with a run waiting on a slow tool or a long turn, it
# seemed to ignore Ctrl-C).
SIGNAL_POLL_S = 0.1


def usable_spec(engine: AgentEngine, spec: SpecParams) -> tuple[SpecParams, str | None]:
    """The script's speculation, or plain decoding plus a one-line warning when the engine lacks its drafter."""
    try:
        engine.drafter(spec.drafter)
    except SpecchatError as error:
        warning = f"drafter {spec.drafter!r} is not available here ({error}); running without speculation"
        return replace(spec, drafter="none"), warning
    return spec, None


def prefix_hit_tokens(engine: AgentEngine) -> int | None:
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
        stats={**merged_stats_json(stats), "prompt_tokens": prompt_tokens},
    )


class AgentSession:
    """Every run of one script on one engine, and the settings they share."""

    def __init__(
        self,
        engine: AgentEngine,
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
        root = script.workspace or Path.cwd()
        try:
            self.schemas = build_toolbox(script.tools, root, confirm).schemas()
        except OSError as error:  # the workspace went after the script was read (the model loads for seconds)
            raise SpecchatError(f"workspace: cannot use {root}: {error.strerror or error}") from None
        self.cancelled = threading.Event()
        self._handles: set = set()
        self._lock = threading.Lock()

    def first_messages(self, task: str) -> list[dict[str, Any]]:
        """The system prompt (with the tools listed when the template does not render them), the script's worked
        examples, and the task."""
        system = self.script.system_prompt
        if self.schemas and not self.structured:
            system = tools_system_prompt(system, self.schemas)
        demos = demo_messages(self.script.examples, self.script.stop, self.structured)
        return [{"role": "system", "content": system}, *demos, {"role": "user", "content": task}]

    def run(self, on_event: EventSink) -> list[RunOutcome]:
        """Run every task, blocking; `on_event` gets each event, from one thread at a time, in order per run."""
        lock = threading.Lock()

        def emit(event: Event) -> None:
            with lock:
                on_event(event)

        started, hits_before = time.perf_counter(), prefix_hit_tokens(self.engine)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="specchat-agent") as pool:
            try:  # (the submits too: a Ctrl-C among them left the runs started going, and the pool waited on them)
                futures = [pool.submit(self._run_one, index, emit) for index in range(len(self.script.tasks))]
                pending = set(futures)
                while pending:  # (SIGNAL_POLL_S) a run that raised (our bug) stops the others now, not at the end
                    done, pending = wait(pending, timeout=SIGNAL_POLL_S, return_when=FIRST_EXCEPTION)
                    for future in done:
                        future.result()
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
        with contextlib.ExitStack() as stack:
            try:
                workspace = stack.enter_context(run_workspace(self.script.workspace, self.script.copy_workspace))
            except OSError as error:  # a full disk, an unreadable file: this run fails, the others go on
                return AgentRun(self, index, None, emit).fail(f"cannot make the run's workspace: {os_problem(error)}")
            try:
                toolbox = build_toolbox(self.script.tools, workspace, self.confirm, cancelled=self.cancelled)
            except OSError as error:  # the shared workspace is gone (an earlier run's code deleted it): this run fails
                return AgentRun(self, index, None, emit).fail(f"cannot use the run's workspace: {os_problem(error)}")
            return AgentRun(self, index, toolbox, emit).run()


def os_problem(error: OSError) -> str:
    """An OSError in words; shutil.copytree's Error (a list of (source, copy, why) for every file that failed) as its
    first file's reason and how many more failed."""
    failures = error.args[0] if isinstance(error, shutil.Error) and error.args else None
    if isinstance(failures, list) and failures and isinstance(failures[0], tuple) and len(failures[0]) == 3:
        more = f" (and {len(failures) - 1} more files)" if len(failures) > 1 else ""
        return f"{failures[0][2]}{more}"
    return str(error)
