"""specchat's Textual app: chats in tabs beside live Speculation, Throughput, Memory and Controls panels.

The engine runs its step loop in its own thread and posts one EngineStep message per step (all requests'
events together); the app routes their text to the chats. Every figure comes from the engine's own telemetry
(a Snapshot read between steps on a timer), and the panels repaint on that timer, so the UI's work does not
grow with the token rate.
"""

from __future__ import annotations

import time
import tomllib
from collections import deque
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import ClassVar, TypeVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, TabbedContent, TabPane

from specchat.config import DRAFTERS, KV_FORMATS, WEIGHT_FORMATS, EngineConfig, SamplingParams, SpecParams
from specchat.engine.api import ChatEngine
from specchat.engine.sequence import Finished, TextDelta
from specchat.errors import SpecchatError
from specchat.registry import cache_dir
from specchat.ui.agent_runs import AgentRuns
from specchat.ui.bridge import EngineBridge, ProgressPoster, load_engine
from specchat.ui.chat import ChatPane, PromptInput
from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from specchat.ui.messages import EngineReading, EngineReady, EngineStep, LoadFailed, LoadProgress
from specchat.ui.metrics import PanelFigures
from specchat.ui.screens import HistoryScreen, LoadScreen
from specchat.ui.settings import ChatSettings, LiveSettings
from specchat.ui.speculation import SpeculationPanel
from specchat.ui.store import ChatStore
from specchat.ui.throughput import ThroughputPanel
from specchat.ui.transcript import to_json, to_markdown, transcript_path

W = TypeVar("W", bound=Widget)
PANEL_REFRESH_S = 0.25  # the engine's snapshot is read, and the panels repainted, this often


class SpecchatApp(AgentRuns, LiveSettings, App[Exception | None]):
    """Chat with a local model and watch speculative decoding work."""

    CSS_PATH = "specchat.tcss"
    TITLE = "specchat"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Stop", id="cancel"),
        Binding("ctrl+t", "new_chat", "New chat", id="new_chat"),
        Binding("f8", "close_chat", "Close chat", id="close_chat", show=False),
        Binding("ctrl+r", "history", "History", id="history"),
        Binding("ctrl+s", "save_markdown", "Save", id="save_markdown"),
        Binding("f6", "copy_reply", "Copy reply", id="copy_reply"),
        Binding("ctrl+up", "k_up", "K+1", id="k_up"),
        Binding("ctrl+down", "k_down", "K-1", id="k_down"),
        Binding("f5", "k_auto", "K auto", id="k_auto", show=False),
        Binding("f2", "next_drafter", "Drafter", id="next_drafter", show=False),
        Binding("f3", "toggle_weights", "Weights", id="toggle_weights", show=False),
        Binding("f4", "toggle_kv", "KV", id="toggle_kv", show=False),
        Binding("ctrl+pagedown", "next_tab", "Next chat", id="next_tab", show=False),
        Binding("ctrl+pageup", "previous_tab", "Previous chat", id="previous_tab", show=False),
    ]

    def __init__(
        self,
        engine: ChatEngine | None = None,
        config: EngineConfig | None = None,
        sampling: SamplingParams | None = None,
        spec: SpecParams | None = None,
        system: str | None = None,
        store: ChatStore | None = None,
        transcript_dir: Path | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.config = config or EngineConfig()
        self.sampling = sampling or SamplingParams()
        spec = spec or SpecParams()
        self.settings = ChatSettings(
            k=spec.k,
            drafter=spec.drafter,
            temperature=self.sampling.temperature,
            weights=None if self.config.weights == "auto" else self.config.weights,
            kv=None if self.config.kv_format == "auto" else self.config.kv_format,
        )
        self.k_max = spec.k_max
        self.system = system
        self.store = store or ChatStore()
        self.transcript_dir = transcript_dir or Path.cwd()
        self.history = self.store.recent_prompts()
        self.metrics = PanelFigures()
        self.bridge: EngineBridge | None = None
        self.requests: dict[int, ChatPane] = {}
        self.step_delays_ms: deque[float] = deque(maxlen=4096)  # engine post -> handled, for the benchmark
        self.chats_opened = 0

    @property
    def main(self) -> Screen:
        """The chat screen (queries go there even while a dialog is on top)."""
        return self.screen_stack[0]

    def widget(self, kind: type[W]) -> W | None:
        """The chat screen's widget of that type; None once the app is closing."""
        try:
            return self.main.query_one(kind)
        except (NoMatches, IndexError):
            return None

    @property
    def model_name(self) -> str:
        spec = self.engine.model_spec if self.engine is not None else None
        return spec.alias if spec is not None else self.config.model

    def compose(self):
        yield Header()
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
            with VerticalScroll(id="side", classes="panels"):
                yield SpeculationPanel(id="speculation")
                yield ThroughputPanel(id="throughput")
                yield MemoryPanel(id="memory")
                yield ControlsPanel(
                    self.settings.k, self.settings.drafter, DRAFTERS, self.settings.temperature, id="controls"
                )
        yield Footer()

    async def on_mount(self) -> None:
        self.load_keymap()
        controls = self.main.query_one(ControlsPanel)
        for name in ("weights", "kv"):
            controls.show(name, getattr(self.settings, name) or "")
        await self.action_new_chat()
        self.set_interval(PANEL_REFRESH_S, self.refresh_panels)
        if self.engine is not None:
            self.attach_engine(self.engine)
        else:
            self.push_screen(LoadScreen(self.config.model))
            self.load_model()

    def on_unmount(self) -> None:
        if self.engine is not None:
            for request_id in list(self.requests):
                self.engine.cancel(request_id)
        if self.bridge is not None:
            self.bridge.detach()

    def load_keymap(self) -> None:
        """Remap bindings by id from $SPECCHAT_HOME/keymap.toml (e.g. `new_chat = "ctrl+n"`)."""
        path = cache_dir() / "keymap.toml"
        if not path.is_file():
            return
        try:
            self.set_keymap({str(k): str(v) for k, v in tomllib.loads(path.read_text()).items()})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            self.notify(f"{path}: {exc}", severity="error")

    # --- the engine ---------------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def load_model(self) -> None:
        """Fetch and load the model off the UI thread; progress comes back as messages."""
        try:
            engine = load_engine(self.config, ProgressPoster(self))
        except SpecchatError as exc:
            self.post_message(LoadFailed(exc))
            return
        self.post_message(EngineReady(engine))

    def on_load_progress(self, message: LoadProgress) -> None:
        if isinstance(self.screen, LoadScreen):
            self.screen.show_progress(message.what, message.done, message.total)

    def on_engine_ready(self, message: EngineReady) -> None:
        if isinstance(self.screen, LoadScreen):
            self.pop_screen()
        self.attach_engine(message.engine)
        self.notify(f"{self.model_name} loaded", timeout=3)

    def on_load_failed(self, message: LoadFailed) -> None:
        self.exit(message.error, return_code=1)

    def attach_engine(self, engine: ChatEngine) -> None:
        """Start listening to the engine and put the model's name in the header."""
        self.engine = engine
        self.bridge = EngineBridge(engine, self)
        self.bridge.attach()
        self.sub_title = self.model_name
        for pane in self.main.query(ChatPane):
            pane.model = self.model_name
        self.request_reading()

    def request_reading(self) -> None:
        if self.bridge is not None:
            self.bridge.request_reading()

    def on_engine_reading(self, message: EngineReading) -> None:
        """The engine's figures: memory to its panel, the rest to the metrics the panels show."""
        if (panel := self.widget(MemoryPanel)) is not None:
            panel.memory = message.memory
        self.metrics.observe(message.snapshot)

    async def on_engine_step(self, message: EngineStep) -> None:
        """Route one step's text to the chats."""
        texts: dict[int, list[str]] = {}
        finished: list[Finished] = []
        for event in message.events:
            if isinstance(event, TextDelta) and event.text:
                texts.setdefault(event.request_id, []).append(event.text)
            elif isinstance(event, Finished):
                finished.append(event)
        for request_id, parts in texts.items():
            pane = self.requests.get(request_id)
            if pane is not None:
                await pane.append("".join(parts))
        for event in finished:
            pane = self.requests.pop(event.request_id, None)
            if pane is not None:
                await pane.finish(event)
        self.step_delays_ms.append((time.perf_counter() - message.time) * 1e3)

    async def refresh_panels(self) -> None:
        """Ask for the next reading and repaint the live panels (on a timer: the cost does not grow with the token
        rate)."""
        self.request_reading()
        for pane in list(self.requests.values()):  # text held back by the stream interval if steps paused
            await pane.show_pending()
        if not self.metrics.dirty or not self.screen_stack:
            return
        self.metrics.dirty = False
        view = self.metrics.view()
        try:
            for kind in (SpeculationPanel, ThroughputPanel):
                if (panel := self.widget(kind)) is not None:
                    panel.view = view
        except NoMatches:  # the app is closing: the panels' children are already gone
            return

    # --- chats --------------------------------------------------------------------------------------------------
    @property
    def chat(self) -> ChatPane | None:
        """The chat in the active tab (None on an agent run's tab)."""
        pane = self.main.query_one(TabbedContent).active_pane
        return next(iter(pane.query(ChatPane)), None) if pane is not None else None

    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        """Send the prompt of a chat to the engine and stream the answer into that chat."""
        pane = next(a for a in message.prompt_input.ancestors if isinstance(a, ChatPane))
        if self.engine is None:
            self.notify("the model is still loading", severity="warning")
            return
        if pane.busy:
            self.notify("this chat is still answering: Esc stops it, Ctrl+T opens another chat", severity="warning")
            return
        try:
            sampling = replace(self.sampling, temperature=self.settings.temperature)
            spec = SpecParams(drafter=self.settings.drafter, k=self.settings.k, k_max=self.k_max)
            messages = [*pane.messages, {"role": "user", "content": message.text}]
            handle = self.engine.submit(messages, sampling, spec, listen_only=True)  # events come as EngineStep
        except SpecchatError as exc:
            self.notify(str(exc), severity="error")
            return
        self.requests[handle.request_id] = pane
        pane.request_id = handle.request_id  # busy from now on, before any await
        message.prompt_input.remember(message.text)
        await pane.add_user(message.text)
        await pane.begin_reply(handle.request_id)
        self.main.query_one(TabbedContent).get_tab(pane.parent.id).label = pane.title

    async def action_new_chat(self) -> ChatPane:
        """Open a new chat in its own tab."""
        self.chats_opened += 1
        pane_id = f"chat-{self.chats_opened}"
        pane = ChatPane(self.store, self.history, self.model_name, self.system)
        tabs = self.main.query_one(TabbedContent)
        await tabs.add_pane(TabPane("new chat", pane, id=pane_id))
        tabs.active = pane_id
        pane.prompt_input.focus()
        return pane

    async def action_close_chat(self) -> None:
        """Close the active chat (its conversation stays saved)."""
        pane = self.chat
        if pane is None:
            return
        if pane.busy:
            self.engine.cancel(pane.request_id)
            self.requests.pop(pane.request_id, None)
        await self.main.query_one(TabbedContent).remove_pane(pane.parent.id)
        if self.chat is None:
            await self.action_new_chat()

    def action_next_tab(self) -> None:
        """Show the next chat."""
        self.main.query_one(TabbedContent).query_one("Tabs").action_next_tab()

    def action_previous_tab(self) -> None:
        """Show the previous chat."""
        self.main.query_one(TabbedContent).query_one("Tabs").action_previous_tab()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Focus the shown chat's input, at once and only while its tab is shown: focusing a widget activates its
        tab, so a focus landing later would take an old tab back (and two such focuses would swap tabs forever)."""
        if event.pane is not event.tabbed_content.active_pane:
            return
        for prompt in event.pane.query(PromptInput):  # none while the tab is being built or torn down
            self.main.set_focus(prompt)

    def action_cancel(self) -> None:
        """Stop the active chat's answer (the text so far is kept), or the runs of the active agent tab."""
        pane = self.chat
        if pane is None:
            self.stop_agent_tab()
        elif pane.busy and self.engine is not None:
            self.engine.cancel(pane.request_id)

    def action_copy_reply(self) -> None:
        """Copy the active chat's last answer to the clipboard."""
        reply = self.chat.last_reply() if self.chat else None
        if reply is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(reply)
        self.notify("answer copied")

    def action_history(self) -> None:
        """Browse saved conversations."""
        self.push_screen(HistoryScreen(self.store), self.open_conversation)

    async def open_conversation(self, conversation_id: int | None) -> None:
        """Show a saved conversation in a tab (the one it is in, if open)."""
        if conversation_id is None:
            return
        tabs = self.main.query_one(TabbedContent)
        for pane in self.main.query(ChatPane):
            if pane.conversation_id == conversation_id:
                tabs.active = pane.parent.id
                return
        pane = self.chat if self.chat is not None and not self.chat.messages else await self.action_new_chat()
        await pane.load(conversation_id)
        tabs.get_tab(pane.parent.id).label = pane.title

    def action_save_markdown(self) -> None:
        """Save the active chat as Markdown."""
        self.save_transcript(".md")

    def action_save_json(self) -> None:
        """Save the active chat as JSON."""
        self.save_transcript(".json")

    def save_transcript(self, suffix: str) -> Path | None:
        pane = self.chat
        if pane is None or not any(m["role"] != "system" for m in pane.messages):
            self.notify("nothing to save yet", severity="warning")
            return None
        path = transcript_path(self.transcript_dir, pane.title, suffix)
        text = (
            to_markdown(pane.title, pane.messages)
            if suffix == ".md"
            else to_json(pane.title, pane.model, pane.messages)
        )
        path.write_text(text)
        self.notify(f"saved {path}")
        return path

    def get_system_commands(self, screen: Screen):
        """The command palette: every action, plus each drafter and format by name."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Open a chat in a new tab", self.action_new_chat)
        yield SystemCommand("Close chat", "Close this tab (the conversation stays saved)", self.action_close_chat)
        yield SystemCommand("History", "Open a saved conversation", self.action_history)
        yield SystemCommand("Save transcript as Markdown", "Write this chat to a .md file", self.action_save_markdown)
        yield SystemCommand("Save transcript as JSON", "Write this chat to a .json file", self.action_save_json)
        yield SystemCommand("Copy last answer", "Copy this chat's last answer", self.action_copy_reply)
        yield SystemCommand("Stop generation", "Cancel this chat's running answer", self.action_cancel)
        yield from self.agent_commands()
        yield SystemCommand("K +1", "One more draft token per step", self.action_k_up)
        yield SystemCommand("K -1", "One draft token fewer per step", self.action_k_down)
        yield SystemCommand("K auto", "Adaptive draft length", self.action_k_auto)
        for name in DRAFTERS:
            yield SystemCommand(f"Drafter: {name}", f"Draft with {name}", partial(self.change_setting, "drafter", name))
        for fmt in WEIGHT_FORMATS:
            yield SystemCommand(f"Weights: {fmt}", f"Weights in {fmt}", partial(self.change_setting, "weights", fmt))
        for fmt in KV_FORMATS:
            yield SystemCommand(f"KV cache: {fmt}", f"KV cache in {fmt}", partial(self.change_setting, "kv", fmt))


def run_tui(config: EngineConfig, sampling: SamplingParams, spec: SpecParams, system: str | None) -> None:
    """Run the app; a load error ends it and is raised here, for the CLI to print as one line."""
    error = SpecchatApp(config=config, sampling=sampling, spec=spec, system=system).run()
    if isinstance(error, Exception):
        raise error
