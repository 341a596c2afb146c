"""Saved conversations in the app: reopening, searching and renaming them in the history, saving a chat as Markdown
or JSON."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import TabbedContent

from specchat.ui.chat import ChatPane
from specchat.ui.screens import HistoryScreen
from specchat.ui.transcript import to_json, to_markdown, transcript_path


class SavedConversations:
    """The saved-conversation half of SpecchatApp (a mixin: it uses the app's store, chats and transcript folder)."""

    def action_history(self) -> None:
        """Browse saved conversations."""
        self.deleted.clear()
        self.push_screen(HistoryScreen(self.store), self.history_closed)

    def on_history_screen_deleted(self, message: HistoryScreen.Deleted) -> None:
        """A deleted conversation's open tabs close (an answer of it stops now): left open, every message sent there
        was dropped by the store (its conversation is gone), and the chat went on unsaved."""
        self.deleted.add(message.conversation_id)
        for pane in self.main.query(ChatPane):
            if pane.conversation_id == message.conversation_id and pane.busy and self.engine is not None:
                self.engine.cancel(pane.request_id)

    async def history_closed(self, conversation_id: int | None) -> None:
        """Back from the history: close the deleted conversations' tabs (now, not under the dialog: a chat opened
        beneath it, its prompt not styled yet, ended the app as the dialog's backdrop drew it), open the one picked."""
        for pane in list(self.main.query(ChatPane)):
            if pane.conversation_id in self.deleted:
                await self.close_chat(pane)
        self.deleted.clear()
        await self.open_conversation(conversation_id)

    def on_history_screen_renamed(self, message: HistoryScreen.Renamed) -> None:
        """Open chats of a renamed conversation show its new title."""
        for pane in self.main.query(ChatPane):
            if pane.conversation_id == message.conversation_id:
                pane.title = message.title
                self.show_title(pane)

    async def open_conversation(self, conversation_id: int | None) -> None:
        """Show a saved conversation in a tab (the one it is in, if open)."""
        if conversation_id is None:
            return
        tabs = self.main.query_one(TabbedContent)
        for pane in self.main.query(ChatPane):
            if pane.conversation_id == conversation_id:
                tabs.active = pane.parent.id
                return
        if self.store.conversation(conversation_id) is None:  # deleted since the history listed it (another
            # specchat): opened, the chat took its dead id, and the store dropped every message sent there
            self.notify(
                "that conversation is no longer saved (deleted meanwhile?), or the store cannot be read now",
                severity="warning",
            )
            return
        pane = (
            self.chat if self.chat is not None and self.chat.conversation_id is None else await self.action_new_chat()
        )
        await pane.load(conversation_id)
        self.show_title(pane)

    def action_save_markdown(self) -> None:
        """Save the active chat as Markdown."""
        self.save_transcript(".md")

    def action_save_json(self) -> None:
        """Save the active chat as JSON."""
        self.save_transcript(".json")

    def save_transcript(self, suffix: str) -> Path | None:
        """Write the active chat as it is shown into the transcript folder; a folder that cannot be written is one
        error notification (the chat itself is in the store either way)."""
        pane = self.chat
        messages = pane.shown_messages() if pane is not None else []
        if not any(m["role"] != "system" for m in messages):
            self.notify("nothing to save yet", severity="warning")
            return None
        text = to_markdown(pane.title, messages) if suffix == ".md" else to_json(pane.title, pane.model, messages)
        try:
            path = transcript_path(self.transcript_dir, pane.title, suffix)
            path.write_text(text, encoding="utf-8", errors="replace")  # a lone surrogate of an old chat: "?"
        except OSError as exc:
            self.notify(f"could not save the chat in {self.transcript_dir}: {exc.strerror or exc}", severity="error")
            return None
        self.notify(f"saved {path}")
        return path
