"""Edge cases a demanding user hits (a QA pass): text that looks like markup, odd characters, bad values, a broken
store or model. Each ends in one clear message in the UI and a chat that goes on, never a traceback."""

from __future__ import annotations

from specchat.engine.sequence import Finished
from specchat.engine.stats import SpecStats
from specchat.ui.chat import MessageView
from tests.ui.conftest import SIZE, send, wait_for
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
