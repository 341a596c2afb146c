"""One chat: the transcript (the user's messages as typed, answers as streamed Markdown) and the prompt input, saved
to the store as it happens."""

from __future__ import annotations

import asyncio
import re
import time
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Label, Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream

from specchat.engine.sequence import Finished
from specchat.ui.pacing import StreamPacer
from specchat.ui.store import ChatStore, storable

NOT_SENT = "not sent"  # the stored reason of a message typed while the model loaded that it could not take
ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System"}
PLACEHOLDER = "Message (Enter sends, Ctrl+J new line)"
WAITING = "waiting for the model…"
INTERRUPTED = "interrupted: the chat closed before the answer ended"
# a terminal's escape sequences in pasted text: CSI (colours, cursor moves), OSC (window title, links), and the
# short ones; what the user wants of a pasted coloured log is its text
ANSI_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-~]")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but tab and newline, DEL, C1


def clean_text(text: str) -> str:
    """Text pasted or sent as the user means it: a surrogate pair (a Windows terminal's emoji) as its character and a
    lone surrogate as U+FFFD (neither UTF-8 nor SQLite takes one), CR LF and CR as line ends, escape sequences and
    other control characters dropped (written to the screen they recoloured it, retitled the window or, cut short,
    swallowed what came after)."""
    text = storable(text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return CONTROL.sub("", ANSI_SEQUENCE.sub("", text))


def visible(text: str) -> str:
    """Text as the screen may show it: each control character but tab and newline as a visible symbol (U+2400's
    block: ␛ for escape), never written to the terminal raw (an answer or a stored message may hold one)."""
    return CONTROL.sub(
        lambda m: chr(0x2400 + ord(m[0])) if m[0] < " " else "\u2421" if m[0] == "\x7f" else "\ufffd", text
    )


def with_user(messages: list[dict], text: str) -> list[dict]:
    """The conversation with the user's `text` as its next turn: joined to a user message that got no answer (one
    typed while the model loaded, then the app quit or the load failed), so that roles still alternate (a chat
    template that insists, as Mistral's and Gemma's do, otherwise refused every later message of that chat)."""
    if messages and messages[-1]["role"] == "user":
        return [*messages[:-1], {"role": "user", "content": f"{messages[-1]['content']}\n\n{text}"}]
    return [*messages, {"role": "user", "content": text}]


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter) starts a new line, Up/Down at the edges walk history."""

    class Submitted(Message):
        """The user sent a prompt."""

        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input = prompt_input
            self.text = text

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, prompts: list[str], **kwargs) -> None:
        super().__init__(
            soft_wrap=True, show_line_numbers=False, tab_behavior="focus", placeholder=PLACEHOLDER, **kwargs
        )
        self.prompts = prompts  # sent prompts, shared by all chats, oldest first
        self.prompt_index: int | None = None  # position while walking the prompts; None = editing a new one
        self.draft = ""

    def _on_paste(self, event: events.Paste) -> None:
        """Pasted text goes in cleaned (clean_text): a coloured log as its text, a lone surrogate as U+FFFD. (Textual
        then calls TextArea's own handler, which inserts it.)"""
        event.text = clean_text(event.text)

    async def _on_key(self, event: events.Key) -> None:
        """Enter sends; Ctrl+J / Shift+Enter insert a newline; everything else edits as usual."""
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = clean_text(self.text).strip()  # what got in otherwise (a recalled prompt) is cleaned too
            if text:
                self.post_message(self.Submitted(self, text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def action_cursor_up(self, select: bool = False) -> None:
        """Up on the first line recalls the previous prompt."""
        if select or self.cursor_location[0] > 0 or not self.prompts:
            super().action_cursor_up(select)
            return
        if self.prompt_index is None:
            self.draft, self.prompt_index = self.text, len(self.prompts)
        if self.prompt_index > 0:
            self.prompt_index -= 1
            self.show_text(self.prompts[self.prompt_index], at_end=False)

    def action_cursor_down(self, select: bool = False) -> None:
        """Down on the last line moves forward in history, back to the prompt being written."""
        if select or self.cursor_location[0] < self.document.line_count - 1 or self.prompt_index is None:
            super().action_cursor_down(select)
            return
        self.prompt_index += 1
        if self.prompt_index >= len(self.prompts):
            self.prompt_index = None
            self.show_text(self.draft, at_end=True)
        else:
            self.show_text(self.prompts[self.prompt_index], at_end=True)

    def show_text(self, text: str, at_end: bool) -> None:
        """Replace the content; the cursor goes to the end, or to the end of the first line."""
        self.load_text(text)
        last = self.document.line_count - 1
        row = last if at_end else 0
        self.move_cursor((row, len(self.document[row])))

    def remember(self, text: str) -> None:
        """Add a sent prompt to history and clear the input."""
        if not self.prompts or self.prompts[-1] != text:
            self.prompts.append(text)
        self.prompt_index = None
        self.clear()


class MessageView(Vertical, can_focus=True):
    """One message of the transcript; focus it and press c to copy it. The user's own text is shown as typed (its
    line breaks kept), the model's as Markdown."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("c", "copy", "Copy message", id="copy_message")]

    def __init__(self, role: str, content: str = "", db_id: int | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.db_id = db_id  # its row in the store

    def compose(self):
        yield Label(ROLE_LABELS.get(self.role, self.role), classes="role")
        shown = visible(self.content)
        yield Markdown(shown) if self.role == "assistant" else Static(Text(shown), classes="text")
        yield Static("", classes="footer")

    def show_text(self, text: str) -> None:
        """Replace a user message's text (a message waiting for the model takes in the next one typed)."""
        self.content = text
        self.query_one(".text", Static).update(Text(visible(text)))

    def action_copy(self) -> None:
        """Copy the message's text to the clipboard."""
        self.app.copy_to_clipboard(self.content)
        self.notify("message copied")

    def set_footer(self, text: str) -> None:
        self.query_one(".footer", Static).update(Text(text))  # an engine's error may hold `[/]`: not markup


def finish_line(event: Finished) -> str:
    """The figures shown under a finished reply."""
    s = event.stats
    parts = [f"{len(event.token_ids)} tokens", f"{event.tok_per_s:.1f} tok/s", f"{s.tokens_per_step or 1:.2f} tok/step"]
    if s.drafted:
        parts.append(f"acceptance {s.acceptance_rate:.0%}")
    parts.append(event.reason if event.error is None else f"error: {event.error} (left out of the conversation)")
    return " · ".join(parts)


class ChatPane(Vertical):
    """A conversation: its messages, its one running request, its row in the store."""

    def __init__(
        self, store: ChatStore, prompts: list[str], model: str, system: str | None = None, welcome: str = "", **kwargs
    ) -> None:
        super().__init__(classes="chat", **kwargs)
        self.welcome = welcome
        self.store = store
        self.prompts = prompts
        self.model = model
        self.conversation_id: int | None = None
        self.title = "new chat"
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.request_id: int | None = None
        self.waiting: MessageView | None = None  # the user's message typed before the engine was ready
        self.reply: MessageView | None = None
        self.reply_stream: MarkdownStream | None = None
        self.reply_text = ""
        self.reply_db_id: int | None = None
        self.unshown = ""  # reply text not handed to the Markdown stream yet
        self.stream_lock = asyncio.Lock()
        self.shown_at = 0.0
        self.pacer = StreamPacer()  # how often the reply's Markdown grows: at most 20 times a second, whatever the
        # token rate, and less while the frames that redraw it take more than a share of a core (ui/pacing.py)

    def compose(self):
        with VerticalScroll(classes="transcript"):
            yield Static(self.welcome, classes="welcome")
        yield PromptInput(self.prompts, classes="prompt")

    def on_mount(self) -> None:
        self.query_one(".transcript", VerticalScroll).anchor()

    def on_unmount(self) -> None:
        """Closed mid-answer (the tab, or the app, even by a crash): the reply keeps all its text, marked so."""
        if self.reply_db_id is not None:
            meta = {"footer": INTERRUPTED, "reason": "interrupted"}
            self.store.update_message(self.reply_db_id, self.reply_text, meta)

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    @property
    def prompt_input(self) -> PromptInput:
        return self.query_one(PromptInput)

    def set_system(self, system: str | None) -> None:
        """A chat not begun yet starts with this system prompt instead; one begun keeps its own."""
        if self.conversation_id is None:
            self.messages = [{"role": "system", "content": system}] if system else []

    def show_welcome(self, text: str) -> None:
        """What the empty chat says: model, settings and the keys that matter (gone with the first message)."""
        self.welcome = text
        for line in self.query(".welcome"):
            line.update(text)

    async def load(self, conversation_id: int) -> None:
        """Show a stored conversation; new messages continue it."""
        self.conversation_id = conversation_id
        found = self.store.conversation(conversation_id)
        self.title = found.title if found else self.title
        stored = self.store.messages(conversation_id)
        self.messages = []  # the stored chat's own system message, if it began with one: not today's prompt
        await self.query(".welcome").remove()
        views = []
        for m in stored:
            if m.role != "system":
                views.append(MessageView(m.role, m.content, m.id))
            if m.meta and m.meta.get("reason") == NOT_SENT:
                continue
            if m.role == "assistant" and m.meta and m.meta.get("reason") == "error":
                if self.messages and self.messages[-1]["role"] == "user":
                    self.messages.pop()  # an answer that ended in an error leaves the conversation with its question
                continue
            if m.role == "user":
                self.messages = with_user(self.messages, m.content)
            else:
                self.messages.append({"role": m.role, "content": m.content})
        await self.query_one(".transcript", VerticalScroll).mount_all(views)
        for view, m in zip(views, [m for m in stored if m.role != "system"], strict=True):
            if m.meta and m.meta.get("footer"):
                view.set_footer(m.meta["footer"])

    async def add_user(self, text: str) -> MessageView:
        """Show and store the user's message (a new conversation starts with its first one)."""
        if self.conversation_id is None:
            self.title = " ".join(text.split())[:48]
            self.conversation_id = self.store.new_conversation(self.title, self.model)
            for m in self.messages:  # the system message
                self.store.add_message(self.conversation_id, m["role"], m["content"])
        view = MessageView("user", text, self.store.add_message(self.conversation_id, "user", text))
        self.messages = with_user(self.messages, text)
        await self.query(".welcome").remove()
        await self.query_one(".transcript", VerticalScroll).mount(view)
        return view

    async def add_waiting(self, text: str) -> None:
        """A message sent before the engine is ready: shown and stored at once, marked as waiting; a second one
        joins it (one turn, so that nothing typed is lost and the conversation still alternates)."""
        if self.waiting is None:
            self.waiting = await self.add_user(text)
            self.waiting.add_class("waiting")
            self.waiting.set_footer(WAITING)
            return
        self.messages = with_user(self.messages, text)
        joined = self.messages[-1]["content"]  # the waiting message and this one, as with_user joins them
        self.waiting.show_text(joined)
        self.store.update_message(self.waiting.db_id, joined)

    def waiting_sent(self, error: str | None = None) -> None:
        """The waiting message went to the engine, or could not: then it stays on screen and in the store, marked
        "not sent", and leaves the messages the model is given."""
        if self.waiting is None:
            return
        self.waiting.remove_class("waiting")
        self.waiting.set_footer("" if error is None else f"not sent: {error}")
        if error is not None:
            self.messages.pop()
            meta = {"footer": f"not sent: {error}", "reason": NOT_SENT}  # so that a reopened chat leaves it out too
            self.store.update_message(self.waiting.db_id, self.waiting.content, meta)
        self.waiting = None

    async def begin_reply(self, request_id: int) -> None:
        """Open an empty assistant message that the request's text will stream into."""
        self.request_id = request_id
        self.reply_text = ""
        self.reply_db_id = self.store.add_message(self.conversation_id, "assistant", "")
        self.reply = MessageView("assistant", db_id=self.reply_db_id)
        await self.query_one(".transcript", VerticalScroll).mount(self.reply)
        self.reply.add_class("streaming")
        self.reply_stream = Markdown.get_stream(self.reply.query_one(Markdown))

    async def append(self, text: str) -> None:
        """New text of the running reply (all of one step at once); shown when the pacer says."""
        if self.reply_stream is None or not text:
            return
        self.reply_text += text
        self.reply.content = self.reply_text
        self.unshown += text
        if self.pacer.due(self.shown_at):
            await self.show_pending()

    async def show_pending(self) -> None:
        """Hand the text received since the last call to the Markdown stream, and to the store: what the chat
        shows is saved (the store's writes do not wait for the disk), so a crash loses none of it."""
        async with self.stream_lock:  # the panel timer and the step handler both call this
            if self.reply_stream is None or not self.unshown:
                return
            text, self.unshown = self.unshown, ""
            self.shown_at = time.monotonic()
            self.store.update_message(self.reply_db_id, self.reply_text)
            await self.reply_stream.write(visible(text))
            self.pacer.observe()

    async def finish(self, event: Finished) -> None:
        """The reply ended: the streamed text (which the engine makes equal to the final one), figures, stored."""
        await self.show_pending()
        self.pacer.pause()
        async with self.stream_lock:
            if self.reply_stream is not None:
                # a reply that ends before any text (a prompt the KV cache turns away) would stop a stream whose task
                # never ran, and Textual's MarkdownStream.stop then raises the task's cancellation here: the chat
                # stayed "answering" for good. One turn of the loop lets the task start.
                await asyncio.sleep(0)
                await self.reply_stream.stop()
                self.reply_stream = None
        footer = finish_line(event)
        text = self.reply_text
        if self.reply is not None:
            self.reply.content = text
            self.reply.remove_class("streaming")
            self.reply.set_footer(footer)
        if event.error is None:
            self.messages.append({"role": "assistant", "content": text})
        elif self.messages and self.messages[-1]["role"] == "user":  # shown and stored, but not given to the model
            self.messages.pop()  # again with its question: a full KV cache would fail every later message
        meta = {"footer": footer, "reason": event.reason, "stats": event.stats.to_json(), "tok_per_s": event.tok_per_s}
        self.store.update_message(self.reply_db_id, text, meta)
        self.request_id, self.reply_stream, self.reply_db_id = None, None, None

    def shown_messages(self) -> list[dict]:
        """The chat as it is shown (a transcript): the system message, then every message on screen, an answer
        that ended in an error and a message that was not sent included, which the model is no longer given."""
        system = [m for m in self.messages[:1] if m["role"] == "system"]
        return system + [{"role": v.role, "content": v.content} for v in self.query(MessageView)]

    def last_reply(self) -> str | None:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None)
