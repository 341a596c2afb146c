"""specchat's Textual app: chats in tabs beside live Speculation, Throughput, Memory and Controls panels.

The engine runs its step loop in its own thread and posts one EngineStep message per step (all requests'
events together); the app routes their text to the chats. Every figure comes from the engine's own telemetry
(a Snapshot read between steps on a timer), and the panels repaint on that timer, so the UI's work does not
grow with the token rate. The model loads behind a notice, not a dialog (ui/loading.py): the prompt takes what
is typed from the first frame.
"""

from __future__ import annotations

import time
import tomllib
from collections import deque
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import ClassVar, TypeVar

from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, TabbedContent, TabPane

from specchat.config import DRAFTERS, KV_FORMATS, WEIGHT_FORMATS, EngineConfig, SamplingParams, SpecParams
from specchat.engine.api import ChatEngine, Request
from specchat.engine.sequence import Finished, TextDelta
from specchat.errors import ContextLengthError, SpecchatError
from specchat.registry import cache_dir
from specchat.ui.agent_runs import AgentRuns
from specchat.ui.bridge import EngineBridge, load_engine
from specchat.ui.chat import ChatPane, PromptInput, clean_text, with_user
from specchat.ui.controls import ControlsPanel
from specchat.ui.loading import EngineLoader, ModelLoading
from specchat.ui.memory import MemoryPanel
from specchat.ui.messages import EngineReading, EngineStep
from specchat.ui.metrics import PanelFigures
from specchat.ui.saved import SavedConversations
from specchat.ui.screens import SystemPromptScreen
from specchat.ui.settings import ChatSettings, LiveSettings, engine_device, model_drafter
from specchat.ui.speculation import SpeculationPanel
from specchat.ui.store import ChatStore
from specchat.ui.throughput import ThroughputPanel
from specchat.ui.welcome import WELCOME_KEYS, welcome_text

W = TypeVar("W", bound=Widget)
NARROW_WIDTH = 72  # columns from which the live panels are shown beside the chat
PANEL_REFRESH_S = 0.25  # the engine's snapshot is read, and the panels repainted, this often
STOPPED_WAITING = "stopped (Esc) before the model was ready"  # a waiting message's footer after Esc: "not sent: ..."


class SpecchatApp(AgentRuns, LiveSettings, ModelLoading, SavedConversations, App[Exception | None]):
    """Chat with a local model and watch speculative decoding work."""

    CSS_PATH = "specchat.tcss"
    TITLE = "specchat"
    # below NARROW_WIDTH columns the 40-column panels leave the chat too little room (at 40 or fewer, none: the
    # prompt's placeholder wrapped at width 0 and crashed the app), so a narrow screen shows the chat alone
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (NARROW_WIDTH, "-wide")]
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Stop", id="cancel"),
        Binding("ctrl+t", "new_chat", "New chat", id="new_chat"),
        Binding("f8", "close_chat", "Close chat", id="close_chat", show=False),
        Binding("ctrl+r", "history", "History", id="history"),
        Binding("ctrl+s", "save_markdown", "Save", id="save_markdown"),
        Binding("f6", "copy_reply", "Copy reply", id="copy_reply", priority=True),  # the prompt's F6 selects a line
        Binding("f2", "next_drafter", "Drafter", id="next_drafter"),
        Binding("ctrl+up", "k_up", "K+1", id="k_up"),
        Binding("ctrl+down", "k_down", "K-1", id="k_down"),
        Binding("f5", "k_auto", "K auto", id="k_auto"),
        Binding("f3", "toggle_weights", "Weights", id="toggle_weights"),
        Binding("f4", "toggle_kv", "KV", id="toggle_kv"),
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
        loader: EngineLoader = load_engine,
        theme: str | None = None,
    ) -> None:
        super().__init__()
        if theme is not None:
            self.theme = theme  # config.toml's, a name cli/defaults.py has checked
        self.engine = engine
        self.config = config or EngineConfig()
        self.loader = loader  # used when no engine is given: config -> engine, in a worker thread
        self.sampling = sampling or SamplingParams()
        spec = spec or SpecParams()
        self.settings = ChatSettings(
            k=spec.k,
            drafter=model_drafter(
                spec.drafter,
                engine.model_spec if engine is not None else self.config.model,
                engine_device(engine) if engine is not None else self.config.chosen_device,
            ),
            temperature=self.sampling.temperature,
            weights=None if self.config.weights == "auto" else self.config.weights,
            kv=None if self.config.kv_format == "auto" else self.config.kv_format,
            system=system,
        )
        self.k_max = spec.k_max
        self.store = store or ChatStore()
        self.transcript_dir = transcript_dir or Path.cwd()
        self.history = self.store.recent_prompts()
        self.metrics = PanelFigures()
        self.bridge: EngineBridge | None = None
        self.requests: dict[int, ChatPane] = {}
        self.step_delays_ms: deque[float] = deque(maxlen=4096)  # engine post -> handled, for the benchmark
        self.chats_opened = 0
        self.keymap: dict[str, str] = {}  # binding id -> key, from $SPECCHAT_HOME/keymap.toml
        self.previous_config: EngineConfig | None = None  # while a switch loads another model: the one before
        self.deleted: set[int] = set()  # conversations deleted in the history shown now: their tabs close after it

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
            with Vertical(id="chat-column"):
                yield TabbedContent(id="chats")
            with Vertical(id="side"):
                with VerticalScroll(classes="panels"):
                    yield SpeculationPanel(id="speculation")
                    yield ThroughputPanel(id="throughput")
                    yield MemoryPanel(id="memory")
                yield ControlsPanel(  # below the scrolling panels, so a growing one never hides it
                    self.settings.k, self.settings.drafter, DRAFTERS, self.settings.temperature, id="controls"
                )
        yield Footer()

    async def on_mount(self) -> None:
        self.load_keymap()
        self.main.query_one(MemoryPanel).dtype = self.config.dtype
        controls = self.main.query_one(ControlsPanel)
        for name in ("weights", "kv"):
            controls.show(name, getattr(self.settings, name) or "")
        self.show_drafter()
        await self.action_new_chat()
        self.set_interval(PANEL_REFRESH_S, self.refresh_panels)
        self.show_store_notes()
        self.set_interval(PANEL_REFRESH_S, self.show_store_notes)
        if self.engine is not None:
            self.attach_engine(self.engine)
        else:
            await self.start_loading()

    def on_unmount(self) -> None:
        if self.engine is not None:
            for request_id in list(self.requests):
                self.engine.cancel(request_id)
        if self.bridge is not None:
            self.bridge.detach()

    def notify(self, message: str, *, markup: bool = False, **kwargs) -> None:
        """A notification shows its text as it is: what it quotes (a title, a path, an error) may hold `[/]`, which
        as markup ended the app with a MarkupError."""
        super().notify(message, markup=markup, **kwargs)

    def show_store_notes(self) -> None:
        """What the chat store has to tell about its file: a broken one moved aside, another process's lock."""
        for note in self.store.take_notes():
            self.notify(note, severity="warning", timeout=10)

    def load_keymap(self) -> None:
        """Remap bindings by id from $SPECCHAT_HOME/keymap.toml (e.g. `new_chat = "ctrl+n"`)."""
        path = cache_dir() / "keymap.toml"
        if not path.is_file():
            return
        try:
            table = tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # a BOM (Windows editors) is not TOML
        except UnicodeDecodeError as exc:  # (it ended the app with a traceback)
            self.notify(f"{path}: not valid UTF-8 (at byte {exc.start}); the default keys apply", severity="error")
            return
        except (OSError, tomllib.TOMLDecodeError) as exc:
            self.notify(f"{path}: {exc}", severity="error")
            return
        bad = [k for k, v in table.items() if not isinstance(v, str) or not v.strip()]
        if bad:  # `new_chat = 5` bound the key 5, `new_chat = ""` took the binding away, in silence
            self.notify(
                f'{path}: {bad[0]} must be a key such as "ctrl+n" (keys separated by commas); it keeps its default',
                severity="error",
            )
        self.keymap = {k: v for k, v in table.items() if k not in bad}
        self.set_keymap(self.keymap)

    def get_key_display(self, binding: Binding) -> str:
        """Function keys as F2 rather than f2 (the footer and the welcome line)."""
        display = super().get_key_display(binding)
        return display.upper() if display[:1] == "f" and display[1:].isdigit() else display

    def key_display(self, binding_id: str) -> str:
        """The key a binding is on now (the keymap's, else the default), as the footer shows it."""
        if binding_id == "command_palette":
            key = self.COMMAND_PALETTE_BINDING
        else:
            default = next(b.key for b in self.BINDINGS if isinstance(b, Binding) and b.id == binding_id)
            key = self.keymap.get(binding_id, default)
        return self.get_key_display(Binding(key.split(",")[0], ""))

    # --- the engine ---------------------------------------------------------------------------------------------
    def attach_engine(self, engine: ChatEngine) -> None:
        """Start listening to the engine and put the model's name in the header."""
        self.engine = engine
        self.bridge = EngineBridge(engine, self)
        self.bridge.attach()
        self.sub_title = self.model_name
        if self.settings.drafter == "default":  # a default that depends on the device, now known
            self.settings.drafter = model_drafter("default", engine.model_spec, engine_device(engine))
        for pane in self.main.query(ChatPane):
            pane.model = self.model_name
        self.show_drafter()
        self.request_reading()

    def request_reading(self) -> None:
        if self.bridge is not None:
            self.bridge.request_reading()

    def on_engine_reading(self, message: EngineReading) -> None:
        """The engine's figures: memory to its panel, the rest to the metrics the panels show."""
        if (panel := self.widget(MemoryPanel)) is not None:
            panel.memory = message.memory
        self.metrics.observe(message.snapshot)
        self.show_welcome()

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
        """Send the prompt of a chat to the engine and stream the answer into that chat; while the model loads,
        the chat keeps it, marked as waiting, until the engine is ready."""
        pane = next(a for a in message.prompt_input.ancestors if isinstance(a, ChatPane))
        if pane.busy:
            self.notify("this chat is still answering: Esc stops it, Ctrl+T opens another chat", severity="warning")
            return
        if self.engine is None:
            message.prompt_input.remember(message.text)
            await pane.add_waiting(message.text)
            self.show_title(pane)
            return
        try:
            handle = self.submit_chat(with_user(pane.messages, message.text))
        except SpecchatError as exc:
            self.notify(self.refusal(pane, exc), severity="error")
            return
        self.requests[handle.request_id] = pane
        pane.request_id = handle.request_id  # busy from now on, before any await
        message.prompt_input.remember(message.text)
        await pane.add_user(message.text)
        await pane.begin_reply(handle.request_id)
        self.show_title(pane)

    def refusal(self, pane: ChatPane, exc: SpecchatError) -> str:
        """Why the engine refused a chat's message; past the context in a chat with earlier turns, that the prompt
        is the whole conversation and how to go on (the count of tokens alone read as if one short message were
        too long)."""
        if isinstance(exc, ContextLengthError) and any(m["role"] == "assistant" for m in pane.messages):
            return f"{exc}; the conversation so far is part of it: {self.key_display('new_chat')} starts a new chat"
        return str(exc)

    def submit_chat(self, messages: list[dict]) -> Request:
        """Submit a conversation with the chats' settings; its events come as EngineStep messages."""
        sampling = replace(self.sampling, temperature=self.settings.temperature)
        spec = SpecParams(drafter=self.settings.drafter, k=self.settings.k, k_max=self.k_max)
        return self.engine.submit(messages, sampling, spec, listen_only=True)

    async def send_waiting(self) -> None:
        """The engine is ready: send each chat's message typed while it loaded."""
        for pane in list(self.main.query(ChatPane)):
            if pane.waiting is None:
                continue
            try:
                handle = self.submit_chat(pane.messages)
            except SpecchatError as exc:
                self.hold_back_waiting(pane, str(exc))
                self.notify(self.refusal(pane, exc), severity="error")
                continue
            self.requests[handle.request_id] = pane
            pane.request_id = handle.request_id
            pane.waiting_sent()
            await pane.begin_reply(handle.request_id)

    @staticmethod
    def hold_back_waiting(pane: ChatPane, why: str) -> None:
        """The chat's waiting message is not sent (`why`): it stays on screen and in the store, marked "not sent", and
        goes back into the prompt box if that is empty, to fix or send again."""
        text = pane.waiting.content
        pane.waiting_sent(why)
        if not pane.prompt_input.text:
            pane.prompt_input.load_text(text)

    def show_title(self, pane: ChatPane) -> None:
        """The chat's tab shows its title (its first message)."""
        self.main.query_one(TabbedContent).get_tab(pane.parent.id).label = Content(pane.title)  # as typed, not markup

    def show_welcome(self) -> None:
        """Empty chats name the model, its settings and the keys that change them (fresh after every change)."""
        panel = self.widget(MemoryPanel)
        if panel is None:  # the app is closing
            return
        memory = panel.memory
        device = self.engine.device.type if self.engine is not None else None
        keys = {binding_id: self.key_display(binding_id) for binding_id, _ in WELCOME_KEYS}
        text = welcome_text(self.model_name, device, self.settings, memory, keys, self.config.dtype)
        for pane in self.main.query(ChatPane):
            if pane.welcome != text:
                pane.show_welcome(text)

    def focus_prompt(self) -> None:
        """Give the keyboard back to the shown tab: a chat's prompt, a run's trace (after a click on a control)."""
        pane = self.main.query_one(TabbedContent).active_pane
        target = next(iter(pane.query("PromptInput, .trace")), None) if pane is not None else None
        if target is not None:
            self.main.set_focus(target)

    async def action_new_chat(self) -> ChatPane:
        """Open a new chat in its own tab."""
        self.chats_opened += 1
        pane_id = f"chat-{self.chats_opened}"
        pane = ChatPane(self.store, self.history, self.model_name, self.settings.system)
        tabs = self.main.query_one(TabbedContent)
        await tabs.add_pane(TabPane("new chat", pane, id=pane_id))
        self.show_welcome()
        tabs.active = pane_id
        self.main.set_focus(pane.prompt_input)  # now: keys typed before the first frame must land here
        return pane

    async def action_close_chat(self) -> None:
        """Close the active chat (its conversation stays saved)."""
        if self.chat is not None:
            await self.close_chat(self.chat)

    async def close_chat(self, pane: ChatPane) -> None:
        """Close a chat's tab, stopping its answer; a new chat opens where none is left."""
        if pane.busy and self.engine is not None:
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
        """Stop the active chat's answer (the text so far is kept), or its message waiting for the model (it was sent
        all the same once the model had loaded), or the runs of the active agent tab; with none of them to stop, a
        first MXFP4 switch's quantization."""
        pane = self.chat
        if pane is None:
            if not self.stop_agent_tab():
                self.cancel_quantizing()
        elif pane.busy and self.engine is not None:
            self.engine.cancel(pane.request_id)
        elif pane.waiting is not None and self.engine is None:
            self.hold_back_waiting(pane, STOPPED_WAITING)
        else:
            self.cancel_quantizing()

    def action_system_prompt(self) -> None:
        """Edit the system prompt that new chats start with."""
        self.push_screen(SystemPromptScreen(self.settings.system), self.set_system_prompt)

    def set_system_prompt(self, system: str | None) -> None:
        """New chats, and open chats not begun yet, start with `system` ("" = none; None = unchanged)."""
        if system is None:
            return
        system = clean_text(system).strip()  # pasted into the field: as the prompt takes it (ui/chat.py)
        self.settings.system = system or None
        for pane in self.main.query(ChatPane):
            pane.set_system(self.settings.system)
        self.show_welcome()
        self.notify("system prompt set for new chats" if system else "new chats start without a system prompt")

    def action_copy_reply(self) -> None:
        """Copy the active chat's last answer to the clipboard."""
        reply = self.chat.last_reply() if self.chat else None
        if reply is None:
            self.notify("no answer to copy yet", severity="warning")
            return
        self.copy_to_clipboard(reply)
        self.notify("answer copied")

    def get_system_commands(self, screen: Screen):
        """The command palette: every action, plus each drafter and format by name."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Open a chat in a new tab", self.action_new_chat)
        yield SystemCommand("Close chat", "Close this tab (the conversation stays saved)", self.action_close_chat)
        yield SystemCommand("History", "Open a saved conversation", self.action_history)
        yield SystemCommand(
            "Switch model", "Load another model of models.toml; the chats stay", self.action_switch_model
        )
        yield SystemCommand("Save transcript as Markdown", "Write this chat to a .md file", self.action_save_markdown)
        yield SystemCommand("Save transcript as JSON", "Write this chat to a .json file", self.action_save_json)
        yield SystemCommand("Copy last answer", "Copy this chat's last answer", self.action_copy_reply)
        yield SystemCommand("System prompt", "Set the system prompt of new chats", self.action_system_prompt)
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


def run_tui(
    config: EngineConfig, sampling: SamplingParams, spec: SpecParams, system: str | None, theme: str | None = None
) -> None:
    """Run the app; a load error ends it and is raised here, for the CLI to print as one line. An app that ended in
    an exception (our bug: Textual has printed its traceback) ends the command with its status, 1, not 0."""
    run_app(SpecchatApp(config=config, sampling=sampling, spec=spec, system=system, theme=theme))


def run_app(app: App) -> None:
    """Run a specchat app to its end: the load error it returns is raised (for the CLI's one line), and an app that
    ended in an exception (our bug: Textual has printed its traceback) ends the command with its status, 1, not 0."""
    error = app.run()
    if isinstance(error, Exception):
        raise error
    if app.return_code:
        raise SystemExit(app.return_code)
