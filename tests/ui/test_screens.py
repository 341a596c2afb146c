"""The history's search and rename, and the system prompt of new chats (issue 18), driven with Pilot."""

from __future__ import annotations

from textual.widgets import Input, OptionList, TextArea

from specchat.ui.app import SpecchatApp
from specchat.ui.screens import HistoryScreen, SystemPromptScreen
from specchat.ui.store import ChatStore
from tests.ui.conftest import SIZE, type_prompt, wait_for
from tests.ui.fake_engine import FakeEngine


def saved(store: ChatStore, title: str, *messages: str) -> int:
    conversation_id = store.new_conversation(title, "tiny")
    for i, text in enumerate(messages):
        store.add_message(conversation_id, "user" if i % 2 == 0 else "assistant", text)
    return conversation_id


def listed(app: SpecchatApp) -> list[str]:
    options = app.screen.query_one("#history-list", OptionList)
    return [str(options.get_option_at_index(i).prompt).split("  ")[0] for i in range(options.option_count)]


async def system_prompt_dialog(pilot, app: SpecchatApp) -> TextArea:
    """Open the system prompt dialog and wait for its field to take the keys."""
    app.action_system_prompt()
    await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen) and app.screen.query(TextArea))
    field = app.screen.query_one(TextArea)
    await wait_for(pilot, lambda: field.has_focus, what="the field")
    return field


def test_the_store_searches_titles_and_messages(store: ChatStore):
    lemons = saved(store, "Lemon cake", "how long to bake it?", "40 minutes")
    tax = saved(store, "Taxes", "what is 100% of_it?", "all of it")
    assert [c.id for c in store.search("LEMON")] == [lemons]  # the title, any case
    assert [c.id for c in store.search("minutes")] == [lemons]  # a message
    assert [c.id for c in store.search("100% of_")] == [tax]  # % and _ are plain characters
    assert store.search("0%o") == [] and [c.id for c in store.search("")] == [tax, lemons]
    store.rename_conversation(lemons, "Citrus baking")
    assert store.conversation(lemons).title == "Citrus baking" and store.conversations()[1].id == lemons


async def test_history_search_narrows_the_list_and_opens_a_match(store: ChatStore):
    lemons = saved(store, "Lemon cake", "how long to bake it?", "40 minutes")
    saved(store, "Taxes", "when are they due?", "April")
    app = SpecchatApp(engine=FakeEngine(), store=store)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        assert listed(app) == ["Taxes", "Lemon cake"]
        await pilot.press(*"minutes")  # typed on the list: it goes to the search
        search = app.screen.query_one("#history-search", Input)
        assert search.value == "minutes" and search.has_focus
        await wait_for(pilot, lambda: listed(app) == ["Lemon cake"], what="the search")
        await pilot.press(*" nowhere")
        await wait_for(pilot, lambda: not app.screen.query_one("#history-list").display, what="no match")
        assert "no conversation mentions" in str(app.screen.query_one("#history-empty").render())
        search.value = "lemon"
        await wait_for(pilot, lambda: listed(app) == ["Lemon cake"])
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.conversation_id == lemons, what="the match to open")
        assert [m["content"] for m in app.chat.messages] == ["how long to bake it?", "40 minutes"]


async def test_history_renames_a_conversation_and_its_open_tab(store: ChatStore):
    lemons = saved(store, "Lemon cake", "how long to bake it?", "40 minutes")
    app = SpecchatApp(engine=FakeEngine(), store=store)
    async with app.run_test(size=SIZE) as pilot:
        await app.open_conversation(lemons)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        await pilot.press("f2")
        field = app.screen.query_one("#history-title", Input)
        await wait_for(pilot, lambda: field.has_focus, what="the title field")
        assert field.value == "Lemon cake"
        field.value = ""
        await pilot.press(*"Baking  notes", "enter")
        await wait_for(pilot, lambda: store.conversation(lemons).title == "Baking notes", what="the rename")
        assert listed(app) == ["Baking notes"] and not field.display
        assert app.chat.title == "Baking notes"
        assert str(app.main.query_one("#chats").get_tab(app.chat.parent.id).label) == "Baking notes"
        await pilot.press("f2", "escape")  # Esc leaves the title as it was, and the dialog open
        assert isinstance(app.screen, HistoryScreen) and store.conversation(lemons).title == "Baking notes"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, HistoryScreen))


async def test_the_system_prompt_applies_to_new_chats(store: ChatStore):
    app = SpecchatApp(engine=FakeEngine(total_tokens=4), store=store, system="Be brief.")
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "begun before the change")
        begun = app.chat
        await wait_for(pilot, lambda: not begun.busy and len(begun.messages) == 3, what="the answer")
        await pilot.press("ctrl+t")
        fresh = app.chat
        assert "System prompt: Be brief." in str(fresh.query_one(".welcome").render())
        assert "System prompt" in {c.title for c in app.get_system_commands(app.screen)}
        field = await system_prompt_dialog(pilot, app)
        assert field.text == "Be brief." and field.has_focus
        field.load_text("Answer in French.\nUse short sentences.")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.settings.system == "Answer in French.\nUse short sentences.")
        assert fresh.messages == [{"role": "system", "content": app.settings.system}]  # not begun: it follows
        assert begun.messages[0] == {"role": "system", "content": "Be brief."}  # begun: keeps its own
        await type_prompt(pilot, "bonjour")
        await wait_for(pilot, lambda: len(fresh.messages) == 3, what="the answer")
        stored = store.messages(fresh.conversation_id)
        assert (stored[0].role, stored[0].content) == ("system", app.settings.system)
        await pilot.press("ctrl+t")
        assert app.chat.messages[0]["content"] == app.settings.system  # new chats get it
        (await system_prompt_dialog(pilot, app)).load_text("  ")
        await pilot.click("#system-save")
        await wait_for(pilot, lambda: app.settings.system is None, what="the prompt cleared")
        assert app.chat.messages == []
        await system_prompt_dialog(pilot, app)
        await pilot.press("x", "escape")  # Esc changes nothing
        await wait_for(pilot, lambda: not isinstance(app.screen, SystemPromptScreen))
        assert app.settings.system is None


async def test_a_reopened_chat_keeps_the_system_prompt_it_began_with(store: ChatStore):
    """A chat opened from the history into the empty tab got the current system prompt in front of its own (two
    system messages), or in front of a chat that began without one: the model was given a conversation that never
    was."""
    plain = saved(store, "No system", "hi", "hello")
    own = store.new_conversation("Own system", "tiny")
    store.add_message(own, "system", "Answer in French.")
    store.add_message(own, "user", "hi")
    store.add_message(own, "assistant", "bonjour")
    app = SpecchatApp(engine=FakeEngine(), store=store, system="Be brief.")
    async with app.run_test(size=SIZE) as pilot:
        assert app.chat.messages == [{"role": "system", "content": "Be brief."}]
        await app.open_conversation(plain)
        assert [m["role"] for m in app.chat.messages] == ["user", "assistant"]
        await pilot.press("ctrl+t")
        await app.open_conversation(own)
        assert [(m["role"], m["content"]) for m in app.chat.messages] == [
            ("system", "Answer in French."),
            ("user", "hi"),
            ("assistant", "bonjour"),
        ]


async def test_a_conversation_deleted_elsewhere_is_not_opened(store: ChatStore):
    """The history lists a conversation that another specchat deletes before Enter: it opened as an empty chat under
    the dead id, and every message sent there was dropped by the store (its conversation gone), the chat unsaved."""
    gone = saved(store, "Deleted elsewhere", "hi", "hello")
    app = SpecchatApp(engine=FakeEngine(total_tokens=4), store=store)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen))
        store.delete_conversation(gone)  # (as another process would)
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, HistoryScreen))
        assert app.chat.conversation_id is None
        assert any("no longer saved" in n.message for n in app._notifications)
        await type_prompt(pilot, "still saved")
        await wait_for(pilot, lambda: len(app.chat.messages) == 2, what="the answer")
        assert store.flush() and [m.content for m in store.messages(app.chat.conversation_id)][:1] == ["still saved"]
