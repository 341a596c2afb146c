"""A new user's first minute (issue 18): the empty chat says what to do, controls give the keyboard back, F6 copies
from the prompt, the user's line breaks stay, toasts and a growing Memory panel leave the Controls in view, K is
off without a drafter, the panel names the drafter and shows only its steps. (The agent-script dialog's path
completion: test_agent_view.py.)"""

from __future__ import annotations

from textual.widgets import Input

from specchat.registry import resolve
from specchat.ui.app import SpecchatApp
from specchat.ui.chat import MessageView
from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from specchat.ui.settings import drafter_description, model_drafter
from specchat.ui.speculation import SpeculationPanel
from tests.ui.conftest import SIZE, type_prompt, wait_for
from tests.ui.fake_engine import FakeEngine
from tests.ui.test_snapshots import MEMORY


def text_of(widget) -> str:
    return str(widget.render())


def answered(pane, turns: int = 1):
    return lambda: len([m for m in pane.messages if m["role"] == "assistant"]) == turns and not pane.busy


async def test_the_empty_chat_names_the_model_settings_and_keys(tiny_engine, make_app):
    app = make_app(tiny_engine, max_tokens=4, ignore_eos=True, drafter="ngram")
    async with app.run_test(size=SIZE) as pilot:
        pane = app.chat
        welcome = pane.query_one(".welcome")
        await wait_for(pilot, lambda: "weights float32" in text_of(welcome), what="the formats from the engine")
        text = text_of(welcome)
        for part in ("on cpu", "drafter ngram, K 4", "KV fp16", "F2 drafter", "^↑ K+1", "F3 weights", "^p every"):
            assert part in text, (part, text)
        assert not [n for n in app._notifications if n.severity != "information"]  # nothing happened: no warning
        await pilot.press("f5")  # K auto: the welcome follows the settings
        await wait_for(pilot, lambda: "K auto" in text_of(welcome))
        await type_prompt(pilot, "hi")
        await wait_for(pilot, lambda: not pane.query(".welcome"), what="the welcome to give way")


async def test_after_a_control_the_keyboard_is_the_prompts(tiny_engine, make_app):
    app = make_app(tiny_engine, max_tokens=4, ignore_eos=True, drafter="ngram")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#k-up")
        await wait_for(pilot, lambda: app.settings.k == 5, what="K + 1")
        assert app.chat.prompt_input.has_focus
        await type_prompt(pilot, "sent, not lost")  # Enter sends it; it does not press + again
        await wait_for(pilot, answered(app.chat), what="the answer")
        assert app.settings.k == 5 and app.chat.messages[0]["content"] == "sent, not lost"
        await pilot.click("#temperature")
        app.main.query_one("#temperature", Input).value = ""
        await pilot.press(*"0.5", "enter")
        await wait_for(pilot, lambda: app.settings.temperature == 0.5, what="the temperature")
        assert app.chat.prompt_input.has_focus


async def test_f6_copies_the_answer_while_the_prompt_has_focus(tiny_engine, make_app):
    app = make_app(tiny_engine, max_tokens=6, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        await type_prompt(pilot, "something to copy")
        await wait_for(pilot, answered(app.chat), what="the answer")
        assert app.chat.prompt_input.has_focus
        await pilot.press("f6")
        assert app.clipboard == app.chat.messages[-1]["content"] != ""
        assert any(n.message == "answer copied" for n in app._notifications)


async def test_the_users_line_breaks_stay_on_screen(tiny_engine, make_app):
    app = make_app(tiny_engine, max_tokens=4, ignore_eos=True)
    async with app.run_test(size=SIZE) as pilot:
        app.chat.prompt_input.load_text("first line\nsecond line\n\n- not a *list*")
        await pilot.press("enter")
        await wait_for(pilot, answered(app.chat), what="the answer")
        user = app.chat.query(MessageView).first()
        assert text_of(user.query_one(".text")) == "first line\nsecond line\n\n- not a *list*"


async def test_toasts_and_a_long_memory_panel_leave_the_controls_in_view():
    app = SpecchatApp(engine=FakeEngine())
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        app.main.query_one(MemoryPanel).memory = {**MEMORY, "kv_capacity_tokens": 10**6}  # every optional row
        app.notify("a long notification that would sit on top of the controls if toasts went bottom right")
        await wait_for(pilot, lambda: app.screen.query("Toast"), what="the toast")
        await pilot.pause(0.3)
        controls = app.main.query_one(ControlsPanel)
        temperature = app.main.query_one("#temperature", Input)
        assert temperature.region.height == 1 and temperature.region.bottom < SIZE[1]  # above the footer, shown
        side = app.main.query_one("#side").region
        for toast in app.screen.query("Toast"):
            assert not toast.region.overlaps(side), (toast.region, side)
            assert not toast.region.overlaps(app.chat.prompt_input.region)
        assert controls.region.bottom <= side.bottom


async def test_k_is_off_without_a_drafter_and_f2_to_f5_are_in_the_footer(tiny_engine, make_app):
    app = make_app(tiny_engine, drafter="none")
    async with app.run_test(size=SIZE) as pilot:
        controls = app.main.query_one(ControlsPanel)
        assert controls.query_one("#k-row").disabled and controls.query_one("#k-hint").display
        await pilot.press("ctrl+up")
        assert app.settings.k == 4
        shown = {key.key: key for key in app.main.query("FooterKey")}
        assert {"f2", "f3", "f4", "f5", "f6"} <= set(shown)
        assert shown["ctrl+up"]._disabled
        await pilot.press("f2")  # the next drafter: ngram
        await wait_for(pilot, lambda: app.settings.drafter == "ngram", what="the drafter")
        assert not controls.query_one("#k-row").disabled and not controls.query_one("#k-hint").display
        await pilot.press("ctrl+up")
        assert app.settings.k == 5


def test_the_panel_says_which_model_drafts():
    default = resolve(None)
    assert (
        drafter_description("draft-model", default)
        == f"draft-model: {default.alias}, the model itself (a check: no speed-up)"
    )
    assert drafter_description("draft-model", None) == f"draft-model: {default.alias} drafts"
    assert drafter_description("ngram", default) == "ngram"
    assert model_drafter("default", default, "cuda") == (default.drafter or "none")
    # the default model's default drafter is the same on either device: named before the device is known
    assert not default.default_drafter_varies() and model_drafter("default", default) == default.drafter
    assert model_drafter("default", default, "cpu") == default.drafter
    assert model_drafter("default", None) == "none" and model_drafter("heads", default) == "heads"


async def test_a_drafter_switch_shows_only_the_new_drafters_steps(tiny_engine, make_app):
    """tiny_engine's draft-model is a second tiny model: every step drafts k. After the switch to none the panel
    must not keep showing its acceptance (the engine's recent window starts afresh)."""
    app = make_app(tiny_engine, max_tokens=8, ignore_eos=True, drafter="draft-model", k=3)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.main.query_one(SpeculationPanel)
        assert text_of(panel.query_one(".drafter")).startswith("drafter      draft-model: ")
        await type_prompt(pilot, "draft for me")
        await wait_for(pilot, answered(app.chat), what="the answer")
        await wait_for(pilot, lambda: app.metrics.view().acceptance_now is not None, what="draft-model's figures")
        app.change_setting("drafter", "none")
        await wait_for(pilot, lambda: app.settings.drafter == "none", what="the switch")
        await wait_for(pilot, lambda: app.metrics.view().tokens_per_step_now is None, what="a fresh window")
        await wait_for(pilot, lambda: "acceptance   n/a" in text_of(panel.query_one(".headline")))
        assert text_of(panel.query_one(".drafter")) == "drafter      none"


async def test_a_draft_model_of_the_model_itself_says_so():
    engine = FakeEngine()
    engine.model_spec = resolve(None)
    app = SpecchatApp(engine=engine)
    async with app.run_test(size=SIZE) as pilot:
        app.change_setting("drafter", "draft-model")
        panel = app.main.query_one(SpeculationPanel).query_one(".drafter")
        await wait_for(pilot, lambda: "the model itself" in text_of(panel), what="the panel to say so")
