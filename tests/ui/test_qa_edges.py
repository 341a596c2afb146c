"""Edge cases a demanding user hits (a QA pass): text that looks like markup, odd characters, bad values, a broken
store or model. Each ends in one clear message in the UI and a chat that goes on, never a traceback."""

from __future__ import annotations

import itertools
import sqlite3
import threading
from pathlib import Path

import pytest
from textual import events
from textual.widgets import Markdown

from specchat.config import SamplingParams, SpecParams
from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats
from specchat.errors import PromptError, SpecchatError
from specchat.ui import store as store_module
from specchat.ui import store_writer
from specchat.ui.app import SpecchatApp
from specchat.ui.chat import MessageView
from specchat.ui.screens import HistoryScreen
from specchat.ui.store import ChatStore
from specchat.ui.store_writer import Write, journals
from tests.ui.conftest import SIZE, press_now, send, wait_for
from tests.ui.fake_engine import FakeEngine


def footer(view: MessageView) -> str:
    return str(view.query_one(".footer").render())


async def test_text_that_looks_like_markup_is_shown_as_typed(make_app, store):
    """A first message holding `[/]` became the tab's label and the history's entry as markup: the app ended with a
    MarkupError the moment it was sent (and again when the history listed it); an error holding it in a footer too."""
    text = "why does [/] close [/dim] and [b what"
    app = make_app(FakeEngine(total_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        await send(pilot, app, text)
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=10, what="the answer")
        assert app.main.query_one("Tabs").active_tab.label.plain == text
        app.action_history()
        await wait_for(pilot, lambda: app.screen.query("#history-list"), timeout=5, what="the history")
        await pilot.pause()
        option = app.screen.query_one("#history-list").get_option_at_index(0)
        assert option.prompt.plain.startswith(f"{text}  ")
        await pilot.press("escape")
        await pane.add_user("again")
        await pane.begin_reply(99)
        await pane.finish(Finished(99, "error", "", [], 9, SpecStats(), 0.0, 0.0, error="bad shape [/] of [2, 3]"))
        assert "error: bad shape [/] of [2, 3]" in footer(pane.query(MessageView).last())
        app.notify(f"saved /tmp/{text}")
        await pilot.pause()
        assert app.is_running


async def test_pasted_control_characters_and_surrogates_are_cleaned(make_app, store):
    """A pasted coloured log put its escape sequences into the prompt and the chat, raw: written to the terminal they
    recoloured the screen or (an OSC cut short) swallowed what followed. A lone surrogate (half an emoji from a
    Windows terminal) killed the store's writer thread: nothing more of any chat was saved."""
    pasted = "\x1b[31mERROR\x1b[0m disk\r\nfull\x00 \x1b]0;title\x07\ud83d\ude00 half \ud800"
    app = make_app(FakeEngine(total_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        app.post_message(events.Paste(pasted))  # as the terminal driver does: the app hands it to the focused prompt
        await wait_for(pilot, lambda: pane.prompt_input.text, timeout=5, what="the paste")
        assert pane.prompt_input.text == "ERROR disk\nfull \U0001f600 half \ufffd"
        pane.prompt_input.load_text("typed \x1b[1mbold\x1b[0m and \ud800")  # recalled from an old store, say
        press_now(app, "enter")
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=10, what="the answer")
        assert pane.messages[0]["content"] == "typed bold and \ufffd"
        await pane.begin_reply(99)
        await pane.append("an answer with \x1b[2J escape")  # a model may emit one
        await pane.show_pending()
        await pilot.pause(0.2)
        shown = pane.reply.query_one(Markdown).source
        assert "\x1b" not in shown and "\u241b[2J" in shown
        await pane.finish(Finished(99, "stop", "", [], 9, SpecStats(), 0.0, 0.0))
    assert store.flush(2.0)
    assert store.messages(pane.conversation_id)[0].content == "typed bold and \ufffd"


def test_a_lone_surrogate_never_stops_the_store(store):
    """A lone surrogate in any write (a system prompt or a title pasted into their fields) ended the store's writer
    thread with a UnicodeEncodeError: every later write of every chat was lost, and each read waited its full second."""
    conversation = store.new_conversation("half \ud83d an emoji", "m")
    store.add_message(conversation, "system", "be \ud800 brief, \ud83d\ude00")
    store.writer.put(Write("rename", ("\udfff", conversation)))  # past the store's own cleaning: dropped, noted
    store.add_message(conversation, "user", "still saved")
    assert store.flush(2.0)
    assert [m.content for m in store.messages(conversation)] == ["be \ufffd brief, \U0001f600", "still saved"]
    assert store.conversation(conversation).title == "half \ufffd an emoji"
    assert any("could not be saved" in note for note in store.take_notes())


async def test_a_system_prompt_with_a_lone_surrogate_is_cleaned_and_the_chat_saves(make_app, tmp_path):
    """A system prompt pasted with half an emoji (or an escape sequence) went into the chat as it was, and Ctrl+S then
    ended the app with a UnicodeEncodeError writing the transcript."""
    app = make_app(FakeEngine(total_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        app.set_system_prompt("be \x1b[1mbrief\x1b[0m \ud800")
        assert app.settings.system == "be brief \ufffd"
        pane = await app.action_new_chat()
        assert pane.messages == [{"role": "system", "content": "be brief \ufffd"}]
        pane.messages[0]["content"] = "from an old store \udfff"  # however one got in, saving never crashes
        await send(pilot, app, "hi")
        await wait_for(pilot, lambda: len(pane.messages) == 3, timeout=10, what="the answer")
        path = app.save_transcript(".md")
        assert path is not None and "from an old store ?" in path.read_text(encoding="utf-8")
        assert app.is_running


async def test_deleting_an_open_conversation_closes_its_tab(make_app, store):
    """Deleting, in the history, a conversation open in a tab (its answer still streaming) left the tab on it: the
    answer went on into a row that was gone, and every message sent there after was dropped by the store (its
    conversation no longer existed), the chat going on unsaved."""
    engine = FakeEngine(steps_per_s=50, total_tokens=2000)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "a long answer, please")
        pane = app.chat
        conversation_id, request_id = pane.conversation_id, pane.request_id
        await wait_for(pilot, lambda: pane.reply_text, timeout=5, what="the answer to stream")
        app.action_history()
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen), timeout=5, what="the history")
        await pilot.pause()
        await pilot.press("delete")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not pane.is_attached, timeout=5, what="the deleted chat's tab to close")
        assert request_id in engine.cancelled and request_id not in app.requests
        new = app.chat
        assert new is not None and new.conversation_id is None
        engine.total_tokens = 5
        await send(pilot, app, "a new chat")
        await wait_for(pilot, lambda: len(new.messages) == 2, timeout=10, what="the next answer")
    assert store.flush(2.0) and store.conversation(conversation_id) is None
    assert [m.content for m in store.messages(new.conversation_id)][:1] == ["a new chat"]
    assert not any("could not be saved" in note for note in store.take_notes())


def test_a_chat_folder_that_cannot_be_made_is_one_line(tmp_path):
    """A data folder that cannot be made (a read-only home, a file where the folder goes) ended `specchat run` with
    an OSError's traceback: the CLI turns only a SpecchatError into its one line."""
    (tmp_path / "home").write_text("a file, not a folder")
    with pytest.raises(SpecchatError, match=r"cannot make the folder of the chat database \(Not a directory\)"):
        ChatStore(tmp_path / "home" / "specchat" / "chats.sqlite3")


class AlternatingEngine(FakeEngine):
    """A fake engine whose chat template insists that roles alternate, as Mistral's and Gemma's do."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.submitted: list[list[dict]] = []

    def submit(self, messages, sampling=None, spec=None, *, listen_only: bool = False):
        roles = [m["role"] for m in messages if m["role"] != "system"]
        if any(a == b for a, b in itertools.pairwise(roles)):
            raise PromptError("the chat template rejected these messages: Conversation roles must alternate")
        self.submitted.append(messages)
        return super().submit(messages, sampling, spec, listen_only=listen_only)


async def test_a_reopened_chat_whose_last_message_got_no_answer_goes_on(make_app, store):
    """A message typed while the model loaded is stored at once; if the app quit (or the load failed) before it was
    answered, the reopened chat ended in that user message and the next one made two in a row: a template that
    insists on alternating roles refused it, and every later message of that chat, for good."""
    conversation = store.new_conversation("typed while loading", "m")
    store.add_message(conversation, "user", "typed while loading")
    engine = AlternatingEngine(total_tokens=4)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await app.open_conversation(conversation)
        pane = app.chat
        await send(pilot, app, "are you there?")
        await wait_for(pilot, lambda: len(engine.submitted) == 1 and not pane.busy, timeout=10, what="the answer")
        assert engine.submitted[0] == [{"role": "user", "content": "typed while loading\n\nare you there?"}]
        assert [m["role"] for m in pane.messages] == ["user", "assistant"]
        await send(pilot, app, "and again")
        await wait_for(pilot, lambda: len(engine.submitted) == 2 and not pane.busy, timeout=10, what="the next answer")
    assert [m.content for m in store.messages(conversation)][:2] == ["typed while loading", "are you there?"]


async def test_a_database_damaged_while_the_app_runs_is_one_message(tmp_path, monkeypatch):
    """The chat database overwritten after the start: Ctrl+R (and opening a chat) ended the app with a traceback of
    sqlite3.DatabaseError. Now the history opens empty, a notification names the damage, the chat goes on, and what
    is typed after it is kept for the next start."""
    monkeypatch.setattr(store_writer, "CLOSE_WAIT_S", 0.3)
    path = tmp_path / "chats.sqlite3"
    store = ChatStore(path)
    conversations = [store.new_conversation(f"chat {n}", "m") for n in range(30)]
    for conversation in conversations:
        store.add_message(conversation, "user", "words " * 200)
    store.close()  # in the main file, not the WAL
    store = ChatStore(path)
    app = SpecchatApp(
        engine=FakeEngine(total_tokens=4),
        sampling=SamplingParams(max_tokens=8),
        spec=SpecParams(drafter="none", k=4),
        store=store,
        transcript_dir=tmp_path,
    )
    async with app.run_test(size=SIZE) as pilot:
        path.write_text("overwritten by another program\n" * 1000)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen), timeout=5, what="the history")
        await wait_for(pilot, lambda: app._notifications, timeout=5, what="the note")
        notes = [n.message for n in app._notifications]
        assert len(notes) == 1 and notes[0].startswith("chats.sqlite3 is damaged ("), notes
        await pilot.press("escape")
        await pilot.press("ctrl+r")  # the damage is told once, not at every later read (it was, now and then)
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen), timeout=5, what="the history again")
        await pilot.pause(0.2)
        assert len(app._notifications) == 1, [n.message for n in app._notifications]
        await pilot.press("escape")
        await app.open_conversation(conversations[0])
        pane = app.chat
        await send(pilot, app, "typed after the damage")
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=10, what="the answer")
        assert app.is_running
    store.close()
    [journal] = journals(path)
    assert "typed after the damage" in journal.read_text()


@pytest.mark.parametrize("fails", ["the file", "its WAL", "the new file"])
def test_a_broken_database_that_cannot_be_moved_aside_is_one_line(tmp_path, monkeypatch, fails):
    """A broken database in a folder where it cannot be renamed (read-only) ended `specchat run` with an OSError's
    traceback; so did a new database that could not be made after the move. Now one line names the file and the
    reason, and the broken file stays as it was (never deleted, never opened beside a stale WAL)."""
    path = tmp_path / "chats.sqlite3"
    path.write_text("these are my notes, not a database\n" * 100)
    path.with_name("chats.sqlite3-wal").write_bytes(b"")
    rename = Path.rename

    def refuse(self: Path, target: Path) -> Path:
        if fails == "the file" or (fails == "its WAL" and self.name.endswith("-wal")):
            raise PermissionError(13, "Permission denied", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse)
    if fails == "the new file":
        monkeypatch.setattr(store_module, "_connect", failing_after_move(store_module._connect))
    with pytest.raises(SpecchatError) as raised:
        ChatStore(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: not a readable chat database (file is not a database)")
    assert "\n" not in message and "Traceback" not in message
    if fails == "the file":
        assert message.endswith("cannot move it aside (Permission denied); move it away to start a new one")
        assert path.read_text().startswith("these are my notes")
    elif fails == "its WAL":
        assert "cannot move chats.sqlite3-wal aside (Permission denied)" in message
        [aside] = tmp_path.glob("chats.sqlite3.broken-*")
        assert aside.read_text().startswith("these are my notes") and not path.exists()
    else:
        assert "moved to chats.sqlite3.broken-" in message and "cannot start a new one (disk I/O error)" in message


def failing_after_move(connect):
    calls = []

    def fail(path):
        calls.append(path)
        if len(calls) > 1:
            raise sqlite3.OperationalError("disk I/O error")
        return connect(path)

    return fail


class SlowSwitchEngine(FakeEngine):
    """A weights switch that takes until the test releases it (as a first MXFP4 quantization takes minutes)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self.asked: list[str] = []

    def set_weights(self, fmt: str, progress=None) -> None:
        self.asked.append(fmt)
        self.release.wait(timeout=30)
        super().set_weights(fmt, progress)


async def test_a_second_switch_while_the_first_runs_is_refused_in_one_note(make_app, store):
    """F3 twice in quick succession: the setting changed only once applied, so the second press asked for MXFP4
    again and ran a second switch beside the first, whose end took the progress bar away while the other ran."""
    from textual.widgets import ProgressBar

    from specchat.ui.controls import ControlsPanel

    engine = SlowSwitchEngine(total_tokens=6)
    app = make_app(engine)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f3")
            await wait_for(pilot, lambda: engine.asked == ["mxfp4"], timeout=10, what="the switch to start")
            await pilot.press("f4")  # another setting may change meanwhile (the engine's lock orders the two)
            await pilot.press("f3")
            await pilot.pause()
            warnings = [n.message for n in app._notifications if n.severity == "warning"]
            assert warnings == ["weights: still switching to mxfp4; change it again once that is done"]
            await wait_for(pilot, lambda: app.settings.kv == "mxfp4", timeout=10, what="the KV switch")
            assert app.main.query_one(ControlsPanel).query(ProgressBar)  # the weights' switch still runs
            engine.release.set()
            await wait_for(pilot, lambda: app.settings.weights == "mxfp4", timeout=10, what="the weights switch")
            await pilot.pause()
            assert engine.asked == ["mxfp4"] and not app.switching
            assert not app.main.query_one(ControlsPanel).query(ProgressBar)
            await pilot.press("f3")  # once done, F3 toggles back
            await wait_for(pilot, lambda: app.settings.weights == "bf16", timeout=10, what="the switch back")
    finally:
        engine.release.set()


async def test_a_chat_past_the_context_says_the_conversation_is_the_prompt(make_app, store):
    """A long chat fills the context: its next message, however short, was refused with "prompt is 280 tokens; the
    model's context holds 256" and no more, as if that message were too long (the plain REPL says the conversation is
    part of it and how to go on). The message stays in the prompt, the conversation as it was."""
    from specchat.errors import ContextLengthError

    class FullContext(FakeEngine):
        def submit(self, messages, *args, **kwargs):
            if len(messages) > 1:
                raise ContextLengthError("prompt is 280 tokens; the model's context holds 256")
            return super().submit(messages, *args, **kwargs)

    app = make_app(FullContext(total_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        await send(pilot, app, "first")
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=10, what="the answer")
        pane.prompt_input.load_text("thanks")
        await pilot.press("enter")
        await pilot.pause()
        [error] = [n.message for n in app._notifications if n.severity == "error"]
        assert error == (
            "prompt is 280 tokens; the model's context holds 256; the conversation so far is part of it: "
            "^t starts a new chat"
        )
        assert pane.prompt_input.text == "thanks" and len(pane.messages) == 2


@pytest.mark.parametrize(
    ("content", "note"),
    [
        (b"\xff\xfenew_chat = 'ctrl+n'", "keymap.toml: not valid UTF-8 (at byte 0); the default keys apply"),
        (b"new_chat = 5", 'keymap.toml: new_chat must be a key such as "ctrl+n"'),
        (b'new_chat = ""', 'keymap.toml: new_chat must be a key such as "ctrl+n"'),
        (b'\xef\xbb\xbfnew_chat = "ctrl+n"', None),  # a BOM (Windows editors) is not a mistake
    ],
    ids=["not-utf8", "number", "empty", "bom"],
)
async def test_a_keymap_file_with_a_mistake_is_one_notification(make_app, tmp_path, monkeypatch, content, note):
    """A keymap.toml that was not UTF-8 ended the app at its start with UnicodeDecodeError's traceback; `new_chat = 5`
    bound the key 5 and `new_chat = ""` unbound New chat, both in silence."""
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    (tmp_path / "keymap.toml").write_bytes(content)
    app = make_app(FakeEngine(total_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        errors = [n.message for n in app._notifications if n.severity == "error"]
        if note is None:
            assert errors == [] and app.keymap == {"new_chat": "ctrl+n"}
        else:
            assert len(errors) == 1 and note in errors[0] and app.keymap == {}
        assert app.key_display("new_chat") == ("^n" if note is None else "^t")


async def test_the_welcome_names_a_model_and_drafter_with_brackets_as_they_are(store, tmp_path):
    """A model folder named `llama [finetuned]` (or a heads file under one) read as markup in the empty chat's welcome:
    `llama ` alone, the bracketed part taken for a style."""
    from specchat.config import EngineConfig

    app = SpecchatApp(
        engine=FakeEngine(),
        config=EngineConfig(model="/models/llama [finetuned]"),
        spec=SpecParams(drafter="heads:/heads/[bold red]v2.safetensors", k=4),
        store=store,
        transcript_dir=tmp_path,
    )
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        welcome = str(app.chat.query_one(".welcome").render())
        assert "/models/llama [finetuned] on cpu" in welcome, welcome
        assert "drafter heads:/heads/[bold red]v2.safetensors, K 4" in welcome, welcome
