"""Screens over the chat: the saved-conversation browser, the model picker and the system prompt."""

from __future__ import annotations

import time
from typing import ClassVar

from textual import events, on
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, TextArea
from textual.widgets.option_list import Option

from specchat.registry import ModelSpec
from specchat.ui.store import ChatStore


class HistoryScreen(ModalScreen[int | None]):
    """Saved conversations, newest first: typing searches their titles and messages, Enter opens one in a new tab,
    F2 renames one, Delete removes one from the store."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="history_close"),
        Binding("delete", "delete_conversation", "Delete", id="history_delete"),
        Binding("f2", "rename", "Rename", id="history_rename"),
        Binding("down", "focus_list", "Results", id="history_results", show=False),
    ]

    class Renamed(Message):
        """A conversation got a new title (open chats show it)."""

        def __init__(self, conversation_id: int, title: str) -> None:
            super().__init__()
            self.conversation_id = conversation_id
            self.title = title

    class Deleted(Message):
        """A conversation was deleted (open chats of it close: nothing more of it could be saved)."""

        def __init__(self, conversation_id: int) -> None:
            super().__init__()
            self.conversation_id = conversation_id

    def __init__(self, store: ChatStore) -> None:
        super().__init__()
        self.store = store
        self.conversations = store.conversations()
        self.renaming: int | None = None  # the conversation whose title is being edited

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(
                "Conversations (type to search, Enter opens, F2 renames, Delete removes, Esc closes)", classes="title"
            )
            yield Input(placeholder="search titles and messages", id="history-search", select_on_focus=False)
            yield OptionList(*self.options(), id="history-list")
            yield Label(self.empty_text(""), id="history-empty")
            yield Input(id="history-title", classes="rename")

    def on_mount(self) -> None:
        self.show_matches("")
        self.query_one("#history-title").display = False
        self.query_one("#history-list" if self.conversations else "#history-search").focus()

    def on_key(self, event: events.Key) -> None:
        """A letter typed on the list goes to the search (so typing searches wherever the focus is)."""
        search = self.query_one("#history-search", Input)
        if event.is_printable and event.character and self.focused is self.query_one("#history-list"):
            event.stop()
            search.focus()
            search.insert_text_at_cursor(event.character)

    def options(self) -> list[Option]:
        """One per conversation: its title as typed (plain text, never markup), then when, how long, which model."""
        options = []
        for c in self.conversations:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            prompt = Content.assemble(f"{c.title}  ", (f"{when} · {c.messages} messages · {c.model}", "dim"))
            options.append(Option(prompt, id=str(c.id)))
        return options

    def empty_text(self, query: str) -> str:
        return f"no conversation mentions {query!r}" if query else "no saved conversations yet"

    def show_matches(self, query: str) -> None:
        """List the conversations that mention `query` (all of them for an empty one), the first highlighted."""
        self.conversations = self.store.search(query) if query else self.store.conversations()
        option_list = self.query_one("#history-list", OptionList)
        option_list.clear_options()
        option_list.add_options(self.options())
        option_list.highlighted = 0 if self.conversations else None
        option_list.display = bool(self.conversations)
        empty = self.query_one("#history-empty", Label)
        empty.update(self.empty_text(query))
        empty.display = not self.conversations

    def highlighted_id(self) -> int | None:
        option_list = self.query_one("#history-list", OptionList)
        if option_list.highlighted is None or not self.conversations:
            return None
        return int(option_list.get_option_at_index(option_list.highlighted).id)

    @on(Input.Changed, "#history-search")
    def on_search_changed(self, event: Input.Changed) -> None:
        """Narrow the list as the search is typed."""
        self.show_matches(event.value.strip())

    @on(Input.Submitted, "#history-search")
    def on_search_submitted(self) -> None:
        """Enter in the search opens the highlighted match."""
        if (conversation_id := self.highlighted_id()) is not None:
            self.dismiss(conversation_id)

    @on(Input.Submitted, "#history-title")
    def on_title_submitted(self, event: Input.Submitted) -> None:
        """Save the new title (an empty one changes nothing)."""
        title = " ".join(event.value.split())
        conversation_id, self.renaming = self.renaming, None
        event.input.display = False
        self.query_one("#history-list").focus()
        if conversation_id is None or not title:
            return
        self.store.rename_conversation(conversation_id, title)
        self.show_matches(self.query_one("#history-search", Input).value.strip())
        self.post_message(self.Renamed(conversation_id, title))
        self.notify("conversation renamed", timeout=2)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """Open the chosen conversation."""
        self.dismiss(int(event.option.id))

    def action_focus_list(self) -> None:
        """From the search to its results."""
        if self.conversations:
            self.query_one("#history-list").focus()

    def action_rename(self) -> None:
        """Edit the highlighted conversation's title in the field below the list."""
        conversation_id = self.highlighted_id()
        if conversation_id is None:
            return
        self.renaming = conversation_id
        field = self.query_one("#history-title", Input)
        field.value = next(c.title for c in self.conversations if c.id == conversation_id)
        field.display = True
        field.focus()

    def action_close(self) -> None:
        """Back to the chat (from a title being edited: back to the list)."""
        if self.renaming is not None:
            self.renaming = None
            self.query_one("#history-title").display = False
            self.query_one("#history-list").focus()
            return
        self.dismiss(None)

    def action_delete_conversation(self) -> None:
        """Delete the highlighted conversation and its messages from the store."""
        conversation_id = self.highlighted_id()
        if conversation_id is None:
            return
        self.store.delete_conversation(conversation_id)
        self.post_message(self.Deleted(conversation_id))
        self.show_matches(self.query_one("#history-search", Input).value.strip())
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
                        Content.assemble(
                            f"{m.alias}{'  (loaded)' if m.alias == self.current else ''}  ", (m.description, "dim")
                        ),
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


class SystemPromptScreen(ModalScreen[str | None]):
    """The system prompt new chats start with: Ctrl+S (or Save) keeps what the field holds, empty for none."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="system_close"),
        Binding("ctrl+s", "save", "Save", id="system_save", priority=True),
    ]

    def __init__(self, system: str | None) -> None:
        super().__init__()
        self.system = system or ""

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(
                "System prompt for new chats (Ctrl+S saves, Esc closes; empty: none; chats begun keep theirs)",
                classes="title",
            )
            yield TextArea(self.system, soft_wrap=True, show_line_numbers=False, id="system-prompt")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="system-save")
                yield Button("Cancel", id="system-cancel")

    def on_mount(self) -> None:
        field = self.query_one("#system-prompt", TextArea)
        field.focus()
        field.move_cursor(field.document.end)

    @on(Button.Pressed, "#system-save")
    def action_save(self) -> None:
        """Keep the prompt as typed ("" = none)."""
        self.dismiss(self.query_one("#system-prompt", TextArea).text.strip())

    @on(Button.Pressed, "#system-cancel")
    def action_close(self) -> None:
        """Back to the chat, the prompt unchanged."""
        self.dismiss(None)


class AgentSettingsScreen(ModalScreen[bool | None]):
    """An agent script wants other weights / KV than the engine runs: switch to the script's (Enter), keep the
    chat's (K), or cancel (Esc). The engine is shared, so a switch applies to the chats too."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Cancel", id="agent_settings_close"),
        Binding("k", "keep", "Keep", id="agent_settings_keep"),
    ]

    def __init__(self, script: str, wanted: str, running: str) -> None:
        super().__init__()
        self.text = (
            f"{script} runs with {wanted}; the engine runs {running} now.\n"
            "Switch the engine to the script's settings (the chats use them too), or keep the chat's?"
        )

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.text, classes="title")
            with Horizontal(classes="buttons"):
                yield Button("Use the script's", variant="primary", id="agent-settings-script")
                yield Button("Keep the chat's (K)", id="agent-settings-keep")
                yield Button("Cancel", id="agent-settings-cancel")

    def on_mount(self) -> None:
        self.query_one("#agent-settings-script", Button).focus()

    @on(Button.Pressed, "#agent-settings-script")
    def use_script(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#agent-settings-keep")
    def action_keep(self) -> None:
        """Run the script on the engine as it is."""
        self.dismiss(False)

    @on(Button.Pressed, "#agent-settings-cancel")
    def action_close(self) -> None:
        """Do not start the script."""
        self.dismiss(None)
