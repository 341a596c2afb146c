"""Agent runs in the app: an agent script's tasks in tabs with live traces, on the engine and panels of the chats.

A session (specchat.agent.runner.AgentSession) runs in a worker thread, its runs in threads of their own that
the engine batches; the Speculation, Throughput and Memory panels read the engine's steps as for chat. The
session's events wait in a queue, and the app is woken by at most one AgentEvents message in flight per
session, however fast the runs stream: it drains the queue and adds each run's events to its tab. Before a
shell command a run's thread posts a ShellQuestion and waits on a Future, which the dialog resolves, or
stopping the runs (Esc, closing the app) resolves as a refusal: no thread waits on the UI forever. A session that
fails (its script's toolbox cannot be built, an OSError, our bug) ends every run it left open with the error in its
tab; the chats and the app go on.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.message import Message
from textual.widgets import TabbedContent, TabPane

from specchat.agent.runner import AgentSession
from specchat.agent.script import AgentScript, load_script
from specchat.agent.trace import Event, RunStart, SessionEnd, session_summary
from specchat.errors import SpecchatError
from specchat.ui.agent_view import AgentRunPane, AgentScriptScreen, ShellConfirmScreen
from specchat.ui.screens import AgentSettingsScreen

EXAMPLES = "examples/agents/*.toml"  # offered in the script dialog, from the working directory


def settle(answer: Future[bool], allowed: bool) -> None:
    """Answer a shell question unless it already has its answer."""
    with contextlib.suppress(InvalidStateError):
        answer.set_result(allowed)


class AgentTabs:
    """One agent session in the app: its run tabs, the queue its events wait in, its open shell questions."""

    def __init__(self, app: App, number: int, script: AgentScript, concurrency: int | None) -> None:
        self.app = app
        self.number = number
        self.script = script
        self.concurrency = concurrency
        self.session: AgentSession | None = None  # made in the worker (a drafter may take a while to load)
        self.panes: dict[int, AgentRunPane] = {}
        self.summary: SessionEnd | None = None
        self.failure: str | None = None  # why the session ended before its runs did
        self.lock = threading.Lock()
        self.queued: list[Event] = []
        self.woken = False  # an AgentEvents message is on its way
        self.stopped = False
        self.run_of_thread: dict[int, int] = {}  # thread id -> the run it is running (a run keeps its thread)
        self.questions: set[Future[bool]] = set()

    @property
    def over(self) -> bool:
        """Every run has ended (or the session failed)."""
        return self.summary is not None or self.failure is not None

    def begin(self, session: AgentSession) -> None:
        """Worker: the session is made; if the runs were stopped meanwhile, they end at once."""
        with self.lock:
            self.session = session
            stopped = self.stopped
        if stopped:
            session.cancel()

    def put(self, event: Event) -> None:
        """Session threads: queue an event, and wake the app unless a wake-up is already on its way."""
        with self.lock:
            if isinstance(event, RunStart):
                self.run_of_thread[threading.get_ident()] = event.run
            self.queued.append(event)
            if self.woken:
                return
            self.woken = True
        self.app.post_message(AgentEvents(self))

    def drain(self) -> list[Event]:
        """UI thread: the events queued since the last drain."""
        with self.lock:
            events, self.queued, self.woken = self.queued, [], False
        return events

    def confirm(self, command: str) -> bool:
        """A run's thread: ask the user whether to run a shell command, and wait for the answer."""
        answer: Future[bool] = Future()
        with self.lock:
            if self.stopped:
                return False
            self.questions.add(answer)
            run = self.run_of_thread.get(threading.get_ident(), 0)
        try:
            if not self.app.post_message(ShellQuestion(self, run, command, answer)):
                return False  # the app has closed
            return answer.result()
        finally:
            with self.lock:
                self.questions.discard(answer)

    def stop(self) -> None:
        """End every run and refuse every open shell question."""
        with self.lock:
            self.stopped = True
            session, questions = self.session, list(self.questions)
        if session is not None:
            session.cancel()
        for answer in questions:
            settle(answer, False)


class AgentEvents(Message):
    """A session has events waiting."""

    def __init__(self, tabs: AgentTabs) -> None:
        super().__init__()
        self.tabs = tabs


class AgentFailed(Message):
    """A session ended in an exception: `problem` says which, in one line."""

    def __init__(self, tabs: AgentTabs, problem: str) -> None:
        super().__init__()
        self.tabs = tabs
        self.problem = problem


class ShellQuestion(Message):
    """A run asks to execute a shell command; `answer` gets whether the user allows it."""

    def __init__(self, tabs: AgentTabs, run: int, command: str, answer: Future[bool]) -> None:
        super().__init__()
        self.tabs = tabs
        self.run = run
        self.command = command
        self.answer = answer


class AgentRuns:
    """The agent half of SpecchatApp (a mixin: it uses the app's engine, tabs and notifications)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent_sessions: list[AgentTabs] = []
        self.shell_waiting: deque[ShellQuestion] = deque()
        self.shell_asking: ShellQuestion | None = None

    async def start_agent(self, script: AgentScript, concurrency: int | None = None) -> AgentTabs:
        """Open a tab per task of the script (the first one shown) and start its runs."""
        tabs = AgentTabs(self, len(self.agent_sessions) + 1, script, concurrency)
        self.agent_sessions.append(tabs)
        container = self.main.query_one(TabbedContent)
        for run, task in enumerate(script.tasks):
            pane = tabs.panes[run] = AgentRunPane(run, task)
            await container.add_pane(TabPane(pane.label, pane, id=f"agent-{tabs.number}-run-{run}"))
        container.active = f"agent-{tabs.number}-run-0"
        self.main.set_focus(tabs.panes[0].query_one(".trace"))  # now: a screen resuming unfocused picks a widget
        self.run_session(tabs, self.engine)
        return tabs

    @work(thread=True, group="agent")
    def run_session(self, tabs: AgentTabs, engine) -> None:
        """Run the session off the UI thread; its events come back through the tabs' queue. An exception ends the
        runs still open with it (a worker's exception would end the app, and the tabs would wait forever)."""
        try:
            session = AgentSession(engine, tabs.script, tabs.concurrency, confirm=tabs.confirm, stream=True)
            if session.warning:
                self.notify(session.warning, severity="warning", timeout=10)
            tabs.begin(session)
            session.run(tabs.put)
        except SpecchatError as exc:
            self.post_message(AgentFailed(tabs, str(exc)))
        except Exception as exc:  # a tool's or the engine's OSError, our bug: its traceback to the log, one line shown
            self.log.error(traceback.format_exc())
            self.post_message(AgentFailed(tabs, f"{type(exc).__name__}: {exc}"))

    async def on_agent_events(self, message: AgentEvents) -> None:
        """Show what the session's runs did since the last wake-up, each run in its tab, then the session's end."""
        tabs, by_run, summary = message.tabs, {}, None
        for event in tabs.drain():
            if isinstance(event, SessionEnd):
                summary = event
            else:
                by_run.setdefault(event.run, []).append(event)
        container = self.widget(TabbedContent)
        if container is None:  # the app is closing
            return
        for run, events in by_run.items():
            pane = tabs.panes[run]
            await pane.show(events)
            container.get_tab(pane.parent.id).label = pane.label
        if summary is not None:
            tabs.summary = summary
            self.notify(session_summary(summary), title=f"agent script {tabs.number} done", timeout=10)

    async def on_agent_failed(self, message: AgentFailed) -> None:
        """The session ended in an exception: every run it left open ends with it, in its tab."""
        tabs = message.tabs
        await self.on_agent_events(AgentEvents(tabs))  # what the runs did before it, first
        container = self.widget(TabbedContent)
        if container is not None:  # (None once the app is closing)
            for pane in tabs.panes.values():
                if pane.state in ("queued", "running"):
                    await pane.fail(message.problem)
                    container.get_tab(pane.parent.id).label = pane.label
        tabs.failure = message.problem
        self.notify(message.problem, title=f"agent script {tabs.number} failed", severity="error", timeout=10)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Focus the shown run's trace (arrow keys scroll it, Tab walks its results), as the app does a chat's input:
        at once and only while its tab is shown."""
        if event.pane is not event.tabbed_content.active_pane:
            return
        for pane in event.pane.query(AgentRunPane):
            self.main.set_focus(pane.query_one(".trace"))

    def agent_tabs(self) -> AgentTabs | None:
        """The session whose run is in the active tab."""
        active = self.main.query_one(TabbedContent).active_pane
        pane = next(iter(active.query(AgentRunPane)), None) if active is not None else None
        return next((tabs for tabs in self.agent_sessions if pane in tabs.panes.values()), None)

    def stop_agent_tab(self) -> bool:
        """Stop the runs of the agent script in the active tab (what they did so far stays shown); False if none
        were running."""
        tabs = self.agent_tabs()
        if tabs is None or tabs.over:
            return False
        tabs.stop()
        self.notify(f"stopping the runs of agent script {tabs.number}", timeout=3)
        return True

    def on_unmount(self) -> None:
        for tabs in self.agent_sessions:
            tabs.stop()

    # --- shell confirmation ----------------------------------------------------------------------------------
    def on_shell_question(self, message: ShellQuestion) -> None:
        self.shell_waiting.append(message)
        if self.shell_asking is None:
            self.ask_next_shell_question()

    def ask_next_shell_question(self) -> None:
        """Show the oldest open shell question (one dialog at a time; questions of stopped runs are skipped)."""
        while self.shell_waiting:
            question = self.shell_waiting.popleft()
            if question.answer.done():
                continue
            self.shell_asking = question
            task = question.tabs.script.tasks[question.run]
            asker = f"agent script {question.tabs.number}, run {question.run + 1}: {task}"
            self.push_screen(ShellConfirmScreen(asker, question.command), self.answer_shell_question)
            return
        self.shell_asking = None

    def answer_shell_question(self, allowed: bool | None) -> None:
        """The dialog's answer goes to the waiting run; the next question, if any, is shown."""
        if self.shell_asking is not None:
            settle(self.shell_asking.answer, bool(allowed))
        self.ask_next_shell_question()

    # --- the command palette ---------------------------------------------------------------------------------
    def agent_commands(self) -> Iterator[SystemCommand]:
        """The palette's agent entries."""
        yield SystemCommand("Run agent script", "Run an agent script's tasks, each in a new tab", self.action_run_agent)

    def action_run_agent(self) -> None:
        """Ask for an agent script and run its tasks in new tabs on the loaded model."""
        if self.engine is None:
            self.notify("the model is still loading", severity="warning")
            return
        examples = sorted(str(path) for path in Path().glob(EXAMPLES))  # relative, as the user types them
        self.push_screen(AgentScriptScreen(examples), self.run_agent_script)

    async def run_agent_script(self, path: Path | None) -> None:
        """Load the script and start it; a bad script is one line of notification, and so is a weights or KV change
        still running (the script's formats are compared with what the engine runs once it has ended)."""
        if path is None:
            return
        try:
            script = load_script(path)
        except SpecchatError as exc:
            self.notify(str(exc), severity="error", timeout=10)
            return
        if script.model != self.model_name:
            self.notify(f"{path.name} names {script.model}; it runs on the loaded {self.model_name}", timeout=5)
        if (changing := self.still_changing(("weights", "kv"), "run it")) is not None:  # (its runs would straddle it)
            self.notify(f"{path.name} not started: {changing}", severity="warning", timeout=10)
            return
        wanted = self.engine.resolve_formats(script.weights, script.kv)
        running = self.engine.resolve_formats(self.settings.weights or "auto", self.settings.kv or "auto")
        if wanted == running:
            await self.start_agent(script)
            return
        text = lambda formats: f"weights {formats[0]} and KV {formats[1]}"
        screen = AgentSettingsScreen(path.name, text(wanted), text(running))
        self.push_screen(screen, partial(self.agent_settings_chosen, script, wanted))

    async def agent_settings_chosen(self, script: AgentScript, wanted: tuple[str, str], switch: bool | None) -> None:
        """Start the script on the engine as it is (False), or once the engine runs the script's settings: switched
        as the Controls switch them (progress bar, a first quantization's note, Esc stops it), the script starting
        only if every switch succeeded."""
        if switch is None:
            return
        if not switch:
            await self.start_agent(script)
            return
        running = self.engine.resolve_formats(self.settings.weights or "auto", self.settings.kv or "auto")
        changes = {
            name: value for name, value, now in zip(("weights", "kv"), wanted, running, strict=True) if value != now
        }
        self.switch_settings(changes, partial(self.start_agent, script), failed=f"{script.path.name} not started")
