"""Loading the model without taking the keyboard: a notice with a progress bar above the chats, never a dialog.

The model loads in a worker thread (the first fetch included) and its progress comes back as messages. The chat's
prompt has focus from the first frame, so what the user types lands in it; a message sent before the engine is
ready waits in its chat, marked "waiting for the model", and goes out the moment the engine is attached. Switching
to another model loads it the same way, the chats staying; if it fails, the previous model is loaded again.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import replace

from textual import work
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Label, ProgressBar

from specchat.config import EngineConfig
from specchat.engine.api import ChatEngine
from specchat.errors import SpecchatError
from specchat.registry import load_registry
from specchat.ui.bridge import ProgressPoster
from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from specchat.ui.messages import EngineReady, LoadFailed, LoadProgress
from specchat.ui.metrics import PanelFigures
from specchat.ui.screens import ModelScreen
from specchat.ui.settings import model_drafter

Progress = Callable[[str, int, int], None]  # what, done, total (0 = unknown)
EngineLoader = Callable[[EngineConfig, Progress], ChatEngine]


class LoadingNotice(Vertical):
    """What is loading and how far it got; the app removes it when the engine is attached."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def compose(self):
        yield Label(self.what("starting…"), classes="what")
        yield ProgressBar(total=None, show_eta=False, classes="progress")

    def what(self, what: str) -> Content:
        """`Loading <model>: <what>`, the model in bold (a path: plain text, never markup)."""
        return Content.assemble("Loading ", (self.model, "bold"), f": {what}")

    def on_mount(self) -> None:
        self.border_title = "Loading"

    def show_progress(self, what: str, done: int, total: int) -> None:
        """Update the label and the bar (indeterminate when total is 0)."""
        self.query_one(".what", Label).update(self.what(what))
        self.query_one(".progress", ProgressBar).update(total=total or None, progress=done)


class ModelLoading:
    """The loading half of SpecchatApp (a mixin: it uses the app's config, loader, chats and attach_engine)."""

    async def start_loading(self) -> None:
        """Show the notice above the chats and load the model in a worker thread."""
        await self.main.query_one("#chat-column").mount(LoadingNotice(self.config.model, id="loading"), before=0)
        self.load_model()

    @work(thread=True, exclusive=True, group="load")
    def load_model(self) -> None:
        """Fetch and load the model off the UI thread; progress comes back as messages."""
        try:
            engine = self.loader(self.config, ProgressPoster(self))
        except SpecchatError as exc:
            self.post_message(LoadFailed(exc))
            return
        except Exception as exc:  # out of memory, a damaged file, our bug: one line, and a switch brings the previous
            # model back (a worker's exception otherwise ended the app with a traceback, chats and all)
            self.log.error(traceback.format_exc())
            error = SpecchatError(f"{self.config.model} did not load: {type(exc).__name__}: {exc}")
            self.post_message(LoadFailed(error))
            return
        self.post_message(EngineReady(engine))

    def on_load_progress(self, message: LoadProgress) -> None:
        for notice in self.main.query(LoadingNotice):
            notice.show_progress(message.what, message.done, message.total)

    async def on_engine_ready(self, message: EngineReady) -> None:
        """Attach the engine, then send what was typed while it loaded."""
        await self.main.query(LoadingNotice).remove()
        self.previous_config = None
        self.attach_engine(message.engine)
        self.notify(f"{self.model_name} loaded", timeout=3)
        await self.send_waiting()

    async def on_load_failed(self, message: LoadFailed) -> None:
        """A model that does not load ends the app, unless it was a switch: then the previous one comes back."""
        if self.previous_config is None:
            self.exit(message.error, return_code=1)
            return
        await self.main.query(LoadingNotice).remove()
        self.notify(f"{message.error}; loading {self.previous_config.model} again", severity="error", timeout=10)
        self.use_config(self.previous_config)
        self.previous_config = None
        await self.start_loading()

    def action_switch_model(self) -> None:
        """Pick another model from models.toml and load it."""
        try:
            models, _ = load_registry()
        except SpecchatError as exc:
            self.notify(str(exc), severity="error")
            return
        self.push_screen(ModelScreen(list(models.values()), self.model_name), self.switch_model)

    async def switch_model(self, model: str | None) -> None:
        """Load `model` in place of this one: the chats stay (a message sent meanwhile waits for it), drafter and
        formats become the new model's defaults, the panels start afresh."""
        if model is None or model == self.model_name:
            return
        if self.engine is None:
            self.notify("a model is still loading", severity="warning")
            return
        if self.requests or not all(tabs.over for tabs in self.agent_sessions):
            self.notify("answers are running: stop them first (Esc)", severity="warning")
            return
        # a change's end would land on the new model (and a quantization go on for the old one)
        if (changing := self.still_changing(self.switching, "switch the model")) is not None:
            self.notify(changing, severity="warning")
            return
        self.bridge.detach()  # stops the old engine's loop if the app started it; the engine goes with its refs
        self.engine, self.bridge = None, None
        self.previous_config = self.config
        self.use_config(replace(self.config, model=model))
        await self.start_loading()

    def use_config(self, config: EngineConfig) -> None:
        """Settings and panels for a model about to load: its models.toml drafter, its formats as configured."""
        self.config = config
        self.settings.drafter = model_drafter("default", config.model, config.chosen_device)
        self.failed_drafter = None  # (F2 goes on from the new model's drafter)
        self.settings.weights = None if config.weights == "auto" else config.weights
        self.settings.kv = None if config.kv_format == "auto" else config.kv_format
        self.metrics = PanelFigures()
        self.sub_title = ""
        if (panel := self.widget(MemoryPanel)) is not None:
            panel.memory = {}
            panel.dtype = config.dtype
        if (controls := self.widget(ControlsPanel)) is not None:
            for name in ("weights", "kv"):
                controls.show(name, getattr(self.settings, name) or "")
        self.show_drafter()
