"""The app under faults (issue 19): a chat database that is not one, another process's lock on it, a crash in the
middle of an answer, an engine step that fails. Nothing typed or streamed is lost and the chat goes on."""

from __future__ import annotations

import os

import pytest

from specchat.config import SamplingParams, SpecParams
from specchat.ui import store_writer
from specchat.ui.app import SpecchatApp
from specchat.ui.chat import INTERRUPTED, MessageView
from tests.ui.conftest import SIZE, press_now, send, type_prompt, wait_for
from tests.ui.test_store import hold_lock


def footer(view: MessageView) -> str:
    return str(view.query_one(".footer").render())


def notified(app: SpecchatApp, text: str) -> bool:
    return any(text in n.message for n in app._notifications)


async def test_a_junk_chat_database_is_moved_aside_and_the_app_says_so(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    (tmp_path / "chats.sqlite3").write_bytes(os.urandom(50_000))
    app = SpecchatApp(  # its own store, at the default path, as `specchat run` makes it
        engine=tiny_engine,
        sampling=SamplingParams(max_tokens=8, ignore_eos=True),
        spec=SpecParams(drafter="none", k=4),
        transcript_dir=tmp_path,
    )
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: notified(app, "moved to chats.sqlite3.broken-"), what="the note")
        await type_prompt(pilot, "hello after the move")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.messages) == 2, what="the answer")
    stored = app.store.messages(pane.conversation_id)
    assert [(m.role, m.content) for m in stored] == [(m["role"], m["content"]) for m in pane.messages]
    app.store.close()
    assert len(list(tmp_path.glob("chats.sqlite3.broken-*"))) == 1


async def test_the_chat_streams_while_another_process_locks_the_database(tiny_engine, make_app, store, monkeypatch):
    monkeypatch.setattr(store_writer, "NOTE_AFTER_S", 0.3)
    app = make_app(tiny_engine, max_tokens=24, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        holder = hold_lock(store.path, 6.0)
        await send(pilot, app, "answer while the file is locked")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.messages) == 2, what="the answer")
        assert holder.poll() is None  # answered while the lock was still held: the UI never waited for it
        await wait_for(pilot, lambda: notified(app, "is locked by another process"), what="the lock note")
        holder.wait()
        await wait_for(pilot, lambda: notified(app, "the changes that waited are saved"), what="the saved note")
    stored = store.messages(pane.conversation_id)
    assert [(m.role, m.content) for m in stored] == [(m["role"], m["content"]) for m in pane.messages]
    assert stored[1].meta["reason"] == "length"


async def test_a_crash_mid_answer_keeps_everything_streamed(roomy_engine, make_app, store):
    app = make_app(roomy_engine, max_tokens=6000, ignore_eos=True)

    def crash() -> None:
        raise RuntimeError("a bug in the app")

    with pytest.raises(RuntimeError, match="a bug in the app"):  # Pilot hands the app's crash on
        async with app.run_test(size=SIZE) as pilot:
            await type_prompt(pilot, "tell me a long story")
            pane = app.chat
            await wait_for(pilot, lambda: len(pane.reply_text) > 200, what="a good part of the answer")
            app.call_later(crash)
            await wait_for(pilot, lambda: not app.is_running, what="the crash")
    streamed = pane.reply_text
    reply = store.messages(pane.conversation_id)[-1]
    assert reply.role == "assistant" and reply.content == streamed  # all of it, not the last flush
    assert reply.meta == {"footer": INTERRUPTED, "reason": "interrupted"}


async def test_a_failing_engine_step_is_an_error_in_the_chat_and_the_next_message_is_answered(
    tiny_engine, make_app, store, monkeypatch
):
    real_run = tiny_engine.spec_step.run
    calls = 0

    def run_failing_once(plan):
        nonlocal calls
        calls += 1
        if calls == 4:  # after the prefill and two decode steps: some text is on screen
            raise RuntimeError("injected device error")
        return real_run(plan)

    monkeypatch.setattr(tiny_engine.spec_step, "run", run_failing_once)
    app = make_app(tiny_engine, max_tokens=24, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "this answer breaks")
        pane = app.chat
        await wait_for(pilot, lambda: pane.request_id is None and pane.reply_text, what="the failed answer")
        failed = pane.query(MessageView).last()
        assert "error: the engine step failed: RuntimeError: injected device error" in footer(failed)
        assert "left out of the conversation" in footer(failed)
        assert failed.content == pane.reply_text != ""  # the text streamed before the failure stays on screen
        assert pane.messages == []  # but the model is not given the cut answer (nor its question) again
        await type_prompt(pilot, "and this one works")
        await wait_for(pilot, lambda: len(pane.messages) == 2, what="the next answer")
        answered = pane.query(MessageView).last()
        assert "24 tokens" in footer(answered) and "length" in footer(answered)
        stored = store.messages(pane.conversation_id)
        assert [m.content for m in stored][2:] == [m["content"] for m in pane.messages]
        assert [m.meta["reason"] for m in stored if m.role == "assistant"] == ["error", "length"]
        assert stored[1].content == failed.content  # everything streamed is stored
    again = make_app(tiny_engine, max_tokens=24, ignore_eos=True)
    async with again.run_test(size=SIZE) as pilot:  # opened later, the failed turn is shown and still left out
        await again.open_conversation(pane.conversation_id)
        await pilot.pause()
        assert [m["content"] for m in again.chat.messages] == [m.content for m in stored][2:]
        assert len(again.chat.query(MessageView)) == 4


async def test_a_prompt_the_kv_cache_turns_away_at_once_frees_the_chat(tiny_model_dir, tiny_engine, make_app, store):
    """A prompt longer than the whole KV pool ends in an error before any text: the error is shown, the chat is free
    and the next message is answered (stopping the reply's Markdown stream raised there, and the chat stayed
    "answering" for good, its reply empty, stored as interrupted)."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    small = Engine.load(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_memory=tiny_engine.pool.bytes_per_token * 64
        )
    )
    app = make_app(small, max_tokens=4, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        pane.prompt_input.load_text(" ".join(["word"] * 80))  # (typed key by key, 200 presses take minutes)
        press_now(app, "enter")
        await wait_for(pilot, lambda: pane.conversation_id is not None and not pane.busy, what="the chat free again")
        failed = pane.query(MessageView).last()
        assert "error: " in footer(failed) and "KV" in footer(failed) and pane.messages == []
        pane.prompt_input.load_text("hi")
        press_now(app, "enter")
        await wait_for(pilot, lambda: len(pane.messages) == 2, timeout=20, what="the next answer")
        assert "4 tokens" in footer(pane.query(MessageView).last())
    stored = store.messages(pane.conversation_id)
    assert [m.meta["reason"] for m in stored if m.role == "assistant"] == ["error", "length"]


async def test_a_reply_that_ends_before_its_stream_ran_frees_the_chat(tiny_engine, make_app):
    """The reply's Markdown stream is stopped before its task ever ran (an answer that ended in an error before
    any text, handled right after the reply opened): Textual's stop raised the task's cancellation into `finish`,
    which left the chat busy for good."""
    from specchat.engine.sequence import Finished
    from specchat.engine.stats import SpecStats

    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE):
        pane = app.chat
        await pane.add_user("a question")
        await pane.begin_reply(99)
        await pane.finish(Finished(99, "error", "", [], 9, SpecStats(), 0.0, 0.0, error="the KV cache is full"))
        assert not pane.busy and pane.messages == []
        assert "error: the KV cache is full" in footer(pane.query(MessageView).last())


def test_an_app_that_ends_in_an_exception_ends_run_with_status_1(tmp_path, monkeypatch):
    """A bug that ended the TUI in an exception printed Textual's traceback, and `specchat run` then exited 0."""
    from specchat.config import EngineConfig
    from specchat.ui.app import run_tui
    from tests.ui.conftest import crash_on_mount

    crash_on_mount(monkeypatch, SpecchatApp, tmp_path)
    with pytest.raises(SystemExit) as ended:
        run_tui(EngineConfig(model="smollm2-135m"), SamplingParams(), SpecParams(), None)
    assert ended.value.code == 1
