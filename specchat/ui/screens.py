"""Screens over the chat: model loading with progress, and the saved-conversation browser."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, ProgressBar
from textual.widgets.option_list import Option

from specchat.ui.store import Conversation


class LoadScreen(ModalScreen[None]):
    """Fetching and loading the model: what is happening and how far it got."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(f"Loading [b]{self.model}[/b]", classes="title")
            yield Label("starting…", classes="what")
            yield ProgressBar(total=None, show_eta=False, classes="progress")

    def show_progress(self, what: str, done: int, total: int) -> None:
        """Update the label and the bar (indeterminate when total is 0)."""
        self.query_one(".what", Label).update(what)
        progress = self.query_one(".progress", ProgressBar)
        progress.update(total=total or None, progress=done)


class HistoryScreen(ModalScreen[int | None]):
    """Saved conversations, newest first: Enter opens one in a new tab."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="history_close")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Conversations (Enter opens, Esc closes)", classes="title")
            options = [
                Option(
                    f"{c.title}  [dim]{time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))}"
                    f" · {c.messages} messages · {c.model}[/dim]",
                    id=str(c.id),
                )
                for c in self.conversations
            ]
            yield OptionList(*options) if options else Label("no saved conversations yet")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Open the chosen conversation."""
        self.dismiss(int(event.option.id))

    def action_close(self) -> None:
        """Back to the chat."""
        self.dismiss(None)
