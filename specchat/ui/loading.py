"""Loading the model without taking the keyboard: a notice with a progress bar above the chats, never a dialog.

The model loads in a worker thread (the first fetch included) and its progress comes back as messages. The chat's
prompt has focus from the first frame, so what the user types lands in it; a message sent before the engine is
ready waits in its chat, marked "waiting for the model", and goes out the moment the engine is attached.
"""

from __future__ import annotations

from collections.abc import Callable

from textual import work
from textual.containers import Vertical
from textual.widgets import Label, ProgressBar

from specchat.config import EngineConfig
from specchat.engine.api import ChatEngine
from specchat.errors import SpecchatError
from specchat.ui.bridge import ProgressPoster
from specchat.ui.messages import EngineReady, LoadFailed, LoadProgress

Progress = Callable[[str, int, int], None]  # what, done, total (0 = unknown)
EngineLoader = Callable[[EngineConfig, Progress], ChatEngine]


class LoadingNotice(Vertical):
    """What is loading and how far it got; the app removes it when the engine is attached."""

    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def compose(self):
        yield Label(f"Loading [b]{self.model}[/b]: starting…", classes="what")
        yield ProgressBar(total=None, show_eta=False, classes="progress")

    def on_mount(self) -> None:
        self.border_title = "Loading"

    def show_progress(self, what: str, done: int, total: int) -> None:
        """Update the label and the bar (indeterminate when total is 0)."""
        self.query_one(".what", Label).update(f"Loading [b]{self.model}[/b]: {what}")
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
        self.post_message(EngineReady(engine))

    def on_load_progress(self, message: LoadProgress) -> None:
        for notice in self.main.query(LoadingNotice):
            notice.show_progress(message.what, message.done, message.total)

    async def on_engine_ready(self, message: EngineReady) -> None:
        """Attach the engine, then send what was typed while it loaded."""
        await self.main.query(LoadingNotice).remove()
        self.attach_engine(message.engine)
        self.notify(f"{self.model_name} loaded", timeout=3)
        await self.send_waiting()

    def on_load_failed(self, message: LoadFailed) -> None:
        self.exit(message.error, return_code=1)
