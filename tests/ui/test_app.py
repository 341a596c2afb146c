"""The app on a real engine (the tiny random model: the plumbing, not the prose, is under test)."""

from __future__ import annotations

import json

from textual.widgets import Markdown

from specchat.ui.app import SpecchatApp
from specchat.ui.chat import MessageView, PromptInput
from specchat.ui.screens import HistoryScreen
from specchat.ui.speculation import SpeculationPanel
from tests.ui.conftest import SIZE, press_now, type_prompt, wait_for


async def test_typed_prompt_streams_tokens(tiny_engine, make_app, store):
    app = make_app(tiny_engine, max_tokens=24, ignore_eos=True)
    before = tiny_engine.snapshot().tokens_total  # the engine's totals count every request it ran
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "hello there")
        pane = app.chat
        await wait_for(pilot, lambda: pane.messages and pane.messages[-1]["role"] == "assistant", what="the answer")
        reply = pane.query(MessageView).last()
        assert reply.content == pane.messages[-1]["content"] != ""
        await wait_for(pilot, lambda: reply.query_one(Markdown).source == reply.content, what="markdown")
        # streamed: one message per step, each carrying that step's text (24 tokens: prefill + 23 steps)
        assert len(app.step_delays_ms) >= 23
        await wait_for(pilot, lambda: app.metrics.total_tokens == before + 24, what="the engine's figures")
        assert "24 tokens" in str(reply.query_one(".footer").render())
        assert pane.prompt_input.text == ""
    stored = store.messages(pane.conversation_id)
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[1].content == pane.messages[-1]["content"]
    assert stored[1].meta["reason"] == "length"


async def test_escape_cancels_and_keeps_the_text(roomy_engine, make_app, store):
    app = make_app(roomy_engine, max_tokens=6000, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "tell me a long story")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.reply_text) > 0 or not pane.busy, what="first tokens")
        press_now(app, "escape")
        await wait_for(pilot, lambda: not pane.busy, what="the cancel")
        assert app.metrics.total_tokens < 6000
        assert "cancelled" in str(pane.query(MessageView).last().query_one(".footer").render())
    assert store.messages(pane.conversation_id)[-1].meta["reason"] == "cancelled"


async def test_raising_k_changes_the_next_step(roomy_engine, make_app):
    app = make_app(roomy_engine, max_tokens=6000, ignore_eos=True, drafter="ngram", k=2)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "count with me")
        pane = app.chat
        await wait_for(pilot, lambda: app.metrics.k_next == 2, what="a step at k=2")
        press_now(app, "ctrl+up")
        await wait_for(pilot, lambda: app.settings.k == 3, what="K raised")
        await wait_for(pilot, lambda: app.metrics.k_next == 3, what="a step at k=3")
        await wait_for(
            pilot, lambda: "k next 3" in str(app.query_one(SpeculationPanel).query_one(".headline").render())
        )
        press_now(app, "escape")
        await wait_for(pilot, lambda: not pane.busy)


async def test_k_field_rejects_bad_values(tiny_engine, make_app):
    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE) as pilot:
        app.change_setting("k", "many")
        app.change_setting("k", "99")
        await pilot.pause()
        assert app.settings.k == 4
        assert any("K must be" in n.message for n in app._notifications)
        assert any("k must be in" in n.message for n in app._notifications)
        app.change_setting("k", "auto")
        assert app.settings.k is None


async def test_missing_or_failing_setter_is_a_notification(tiny_engine, make_app):
    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE) as pilot:
        app.change_setting("drafter", "no-such-drafter")
        await wait_for(pilot, lambda: any("no-such-drafter" in n.message for n in app._notifications))
        assert app.settings.drafter == "none"
        await pilot.press("f4")  # KV toggle: a notification whether set_kv exists or not
        await wait_for(pilot, lambda: any(n.message.startswith("kv") for n in app._notifications))
        assert app.is_running


async def test_two_chats_run_at_once(tiny_engine, make_app):
    app = make_app(tiny_engine, max_tokens=200, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        first = app.chat
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: app.chat is not first and app.chat.prompt_input.has_focus, what="a new tab")
        second = app.chat
        for pane, text in ((first, "first chat"), (second, "second chat")):  # one right after the other
            pane.prompt_input.post_message(PromptInput.Submitted(pane.prompt_input, text))
        await wait_for(pilot, lambda: first.busy and second.busy, what="both requests submitted")
        assert len(app.requests) == 2
        press_now(app, "ctrl+pageup")
        await wait_for(pilot, lambda: app.chat is first, what="back to the first tab")
        await wait_for(pilot, lambda: not first.busy and not second.busy, timeout=240, what="both answers")
        assert first.messages[-1]["role"] == second.messages[-1]["role"] == "assistant"
        assert [first.title, second.title] == ["first chat", "second chat"]


async def test_history_reloads_and_prompts_recall(tiny_engine, make_app, store, tmp_path):
    app = make_app(tiny_engine, max_tokens=8, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "remember this conversation")
        pane = app.chat
        await wait_for(pilot, lambda: len(pane.messages) == 2, what="the answer")
        answer = pane.messages[1]["content"]
    conversation_id = pane.conversation_id

    again = make_app(tiny_engine)
    async with again.run_test(size=SIZE) as pilot:
        await pilot.press("up")  # prompt history comes from the store
        assert again.chat.prompt_input.text == "remember this conversation"
        await pilot.press("down")
        assert again.chat.prompt_input.text == ""
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(again.screen, HistoryScreen))
        await pilot.press("enter")
        await wait_for(pilot, lambda: again.chat.conversation_id == conversation_id, what="the reload")
        chat = again.chat
        await wait_for(pilot, lambda: len(chat.query(MessageView)) == 2)
        assert [v.content for v in chat.query(MessageView)] == ["remember this conversation", answer]
        await type_prompt(pilot, "and continue it")
        await wait_for(pilot, lambda: len(chat.messages) == 4, what="the follow-up answer")
    assert len(store.messages(conversation_id)) == 4


async def test_history_deletes_a_conversation(tiny_engine, make_app, store):
    app = make_app(tiny_engine, max_tokens=4, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        for prompt in ("first conversation", "second conversation"):
            await type_prompt(pilot, prompt)
            pane = app.chat
            await wait_for(pilot, lambda pane=pane: len(pane.messages) == 2, what="the answer")
            await pilot.press("ctrl+t")
        newest, older = [c.id for c in store.conversations()[:2]]
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        await pilot.press("delete")  # the highlighted one: the newest
        await wait_for(pilot, lambda: store.conversation(newest) is None, what="the deletion")
        assert store.conversation(older) is not None and store.messages(newest) == []


async def test_save_transcript(tiny_engine, make_app, tmp_path):
    app = make_app(tiny_engine, max_tokens=8, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "save me")
        await wait_for(pilot, lambda: len(app.chat.messages) == 2)
        await pilot.press("ctrl+s")
        md = app.save_transcript(".md")
        js = app.save_transcript(".json")
    assert md.read_text().startswith("# save me\n") and "## You\n\nsave me" in md.read_text()
    data = json.loads(js.read_text())
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert len(list(tmp_path.glob("specchat-save-me-*.md"))) == 2


async def test_a_transcript_is_the_chat_as_shown_and_a_folder_that_fails_is_one_notification(
    tiny_engine, make_app, tmp_path
):
    """An answer that ended in an error is left out of what the model is given but not out of the transcript
    (it saved as "nothing to save yet"); a transcript folder that cannot be written is an error notification, and
    the app goes on (Ctrl+S ended it with a traceback)."""
    from specchat.engine.sequence import Finished
    from specchat.engine.stats import SpecStats

    app = make_app(tiny_engine)
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        await pane.add_user("Tell me a story.")
        await pane.begin_reply(99)
        await pane.append("Once upon")
        await pane.finish(
            Finished(99, "error", "Once upon", [1], 9, SpecStats(), 0.0, 0.0, error="the KV cache is full")
        )
        assert pane.messages == []
        saved = app.save_transcript(".md")
        assert saved is not None and "## You\n\nTell me a story." in saved.read_text()
        assert "## Assistant\n\nOnce upon" in saved.read_text()
        app.transcript_dir = tmp_path / "missing" / "folder"
        await pilot.press("ctrl+s")
        assert app.save_transcript(".json") is None and app.is_running
        assert any("could not save the chat" in n.message for n in app._notifications)


async def test_command_palette_lists_actions(tiny_engine, make_app):
    app: SpecchatApp = make_app(tiny_engine)
    async with app.run_test(size=SIZE):
        titles = {c.title for c in app.get_system_commands(app.screen)}
    assert {"New chat", "History", "Save transcript as JSON", "K +1", "Drafter: ngram", "Weights: mxfp4"} <= titles


async def test_a_narrow_terminal_shows_the_chat_alone_and_never_crashes(tiny_engine, make_app):
    """At 40 columns and fewer the 40-column panels left the chat no width, and the prompt's placeholder wrapping at
    width 0 ended the app with a traceback (a QA pass): a narrow screen hides the panels; wide again, they return."""
    app = make_app(tiny_engine, max_tokens=4, ignore_eos=True)
    async with app.run_test(size=(40, 12)) as pilot:
        await pilot.pause()
        assert app.screen.has_class("-narrow") and not app.query_one("#side").display
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: len(app.chat.messages) == 2, what="the answer")
        for size in ((30, 10), (12, 5), (120, 40)):
            await pilot.resize_terminal(*size)
            await pilot.pause()
        assert app.is_running and app.screen.has_class("-wide") and app.query_one("#side").display
