"""Screens over the chat: the saved-conversation browser and the model picker."""

from __future__ import annotations

import time
from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from specchat.registry import ModelSpec
from specchat.ui.store import ChatStore


class HistoryScreen(ModalScreen[int | None]):
    """Saved conversations, newest first: Enter opens one in a new tab, Delete removes one from the store."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="history_close"),
        Binding("delete", "delete_conversation", "Delete", id="history_delete"),
    ]

    def __init__(self, store: ChatStore) -> None:
        super().__init__()
        self.store = store
        self.conversations = store.conversations()

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Conversations (Enter opens, Delete removes, Esc closes)", classes="title")
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

    def action_delete_conversation(self) -> None:
        """Delete the highlighted conversation and its messages from the store."""
        options = self.query(OptionList)
        if not options or options.first().highlighted is None:
            return
        option_list = options.first()
        option = option_list.get_option_at_index(option_list.highlighted)
        self.store.delete_conversation(int(option.id))
        option_list.remove_option(option.id)
        self.notify("conversation deleted", timeout=2)


class ModelScreen(ModalScreen[str | None]):
    """The models of models.toml: Enter loads the highlighted one in place of this one, Esc closes."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="model_close")]

    def __init__(self, models: list[ModelSpec], current: str) -> None:
        super().__init__()
        self.models = models
        self.current = current

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Switch model (Enter loads it, the chats stay; Esc closes)", classes="title")
            yield OptionList(
                *(
                    Option(
                        f"{m.alias}{'  (loaded)' if m.alias == self.current else ''}  [dim]{m.description}[/dim]",
                        id=m.alias,
                    )
                    for m in self.models
                )
            )

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Load the chosen model."""
        self.dismiss(event.option.id)

    def action_close(self) -> None:
        """Back to the chat."""
        self.dismiss(None)
