"""Live settings: a first switch to MXFP4 weights quantizes the model for minutes; the app says so before it starts,
shows the time left, and Esc (or quitting) stops it with nothing changed."""

from __future__ import annotations

import threading
import time

from textual.widgets import Label, ProgressBar

from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from tests.ui.conftest import SIZE, press_now, send, wait_for
from tests.ui.fake_engine import FakeEngine

LINEARS = 200


class QuantizingEngine(FakeEngine):
    """A model with no MXFP4 checkpoint cached: its first switch reports GPTQ progress over LINEARS linears, one
    every 50 ms once the test lets it begin, until done or until its progress callback raises (a stop)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.begin = threading.Event()
        self.asked: list[str] = []
        self.ended: str | None = None  # "done" | the exception that ended the quantization

    def memory(self) -> dict:
        return {**super().memory(), "weights_mxfp4_needs_gptq": self.settings.get("weights") != "mxfp4"}

    def set_weights(self, fmt: str, progress=None) -> None:
        self.asked.append(fmt)
        self.begin.wait(timeout=30)
        try:
            for done in range(1, LINEARS + 1):
                time.sleep(0.05)
                progress("GPTQ", done, LINEARS)
        except Exception as exc:
            self.ended = type(exc).__name__
            raise
        self.ended = "done"
        super().set_weights(fmt, progress)


def note(app) -> Label:
    return app.main.query_one(ControlsPanel).query_one("#switch-note", Label)


async def start_quantizing(pilot, app, engine: QuantizingEngine, running: bool = False) -> None:
    """F3 once the engine's figures are in (they say a switch quantizes first); `running`: and the quantization let
    begin, until its progress shows."""
    await wait_for(pilot, lambda: app.main.query_one(MemoryPanel).memory, timeout=10, what="the engine's figures")
    await pilot.press("f3")
    await wait_for(pilot, lambda: engine.asked == ["mxfp4"], timeout=10, what="the switch to start")
    if running:
        engine.begin.set()
        await wait_for(pilot, lambda: "left" in str(note(app).render()), timeout=10, what="the progress")


async def test_a_first_mxfp4_switch_says_what_it_does_before_it_starts(make_app, store):
    """F3 on a model with no cached MXFP4 checkpoint quantized for minutes behind a bare progress bar; a toast came
    only once the first linear was done, and said nothing of how long."""
    engine = QuantizingEngine(total_tokens=6)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_quantizing(pilot, app, engine)
        await pilot.pause()
        told = [n for n in app._notifications if n.title == "Quantizing to MXFP4"]
        assert len(told) == 1, [n.message for n in app._notifications]
        for words in (
            "no MXFP4 checkpoint yet",
            "once",
            "cached",
            "It takes ",
            " on this CPU when idle, longer",
            "Esc stops",
        ):
            assert words in told[0].message
        assert note(app).display and str(note(app).render()).startswith("quantizing to MXFP4, once: ")
        engine.begin.set()
        await wait_for(pilot, lambda: "left" in str(note(app).render()), timeout=10, what="the time left")
        assert str(note(app).render()).startswith("MXFP4 GPTQ ") and str(note(app).render()).endswith(
            " left · Esc stops"
        )
        await wait_for(pilot, lambda: app.settings.weights == "mxfp4", timeout=30, what="the switch")
        await pilot.pause()
        assert not note(app).display and not app.main.query_one(ControlsPanel).query(ProgressBar)


async def test_escape_stops_the_quantization_and_the_chat_goes_on(make_app, store):
    """The quantization could not be stopped: the one way out of a 45-minute GPTQ was to wait."""
    engine = QuantizingEngine(total_tokens=6)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_quantizing(pilot, app, engine, running=True)
        press_now(app, "escape")  # the chat has no answer running: Esc stops the quantization
        await wait_for(pilot, lambda: not app.switching, timeout=10, what="the switch to end")
        await pilot.pause()
        assert engine.ended == "SwitchStopped" and "weights" not in engine.settings
        assert app.settings.weights is None  # as loaded
        assert any(n.message == "weights: quantizing to mxfp4 stopped; nothing changed" for n in app._notifications)
        assert not [n.message for n in app._notifications if n.severity == "error"]
        assert not app.main.query_one(ControlsPanel).query(ProgressBar) and not note(app).display
        await send(pilot, app, "still there?")
        await wait_for(pilot, lambda: len(app.chat.messages) == 2, timeout=10, what="an answer")


async def test_quitting_stops_the_quantization(make_app, store):
    """Quitting mid-quantization left its thread running: the process waited for the whole GPTQ before it ended."""
    engine = QuantizingEngine(total_tokens=6)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_quantizing(pilot, app, engine, running=True)
    deadline = time.monotonic() + 5
    while engine.ended is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.ended == "SwitchStopped"


async def test_a_model_switch_waits_for_a_quantization(make_app, store):
    """Switch model during a first MXFP4 switch dropped the engine under the running quantization, which went on
    for minutes, and its end set the new model's weights to mxfp4 in the Controls while it ran bf16."""
    engine = QuantizingEngine(total_tokens=6)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_quantizing(pilot, app, engine)
        await app.switch_model("another-model")
        await pilot.pause()
        assert app.engine is engine and app.bridge is not None and app.config.model != "another-model"
        warnings = [n.message for n in app._notifications if n.severity == "warning"]
        assert warnings == ["weights still changing: switch the model once that is done, or Esc stops the quantization"]
        engine.begin.set()
        press_now(app, "escape")
        await wait_for(pilot, lambda: not app.switching, timeout=10, what="the switch to end")


async def test_a_setting_that_reports_while_the_app_closes_ends_nothing(make_app, store):
    """Quitting mid-quantization: a progress or end message still on its way reached a Controls panel whose children
    were already torn down, and the app ended with NoMatches' traceback instead of quitting."""
    from specchat.ui.messages import SettingApplied, SettingProgress

    engine = QuantizingEngine(total_tokens=6)
    app = make_app(engine)
    async with app.run_test(size=SIZE) as pilot:
        await start_quantizing(pilot, app, engine, running=True)
        await app.main.query_one(ControlsPanel).remove_children()  # as the app's teardown leaves it
        app.on_setting_progress(SettingProgress("GPTQ", 3, LINEARS))
        app.on_setting_applied(SettingApplied("weights", "mxfp4", cancelled=True))
        app.on_setting_applied(SettingApplied("drafter", "ngram"))
        assert app.cancel_quantizing() is False and not app.switching
        await pilot.pause()
    assert app.return_value is None


async def test_f2_goes_past_a_drafter_that_cannot_be_built(make_app, store):
    """On a model without trained heads F2 went ngram -> heads (refused) -> heads (refused) ... for good: the drafters
    after it were out of its reach."""
    from specchat.config import DRAFTERS
    from specchat.errors import ConfigError

    class NoHeads(FakeEngine):
        def set_drafter(self, name: str, request_id: int | None = None) -> None:
            self.settings.setdefault("asked", []).append(name)
            if "heads" in name:
                raise ConfigError(f"no trained draft heads for this model ({name})")
            super().set_drafter(name, request_id)

    engine = NoHeads(total_tokens=6)
    app = make_app(engine, drafter="ngram")
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(len(DRAFTERS)):
            await pilot.press("f2")
            await wait_for(pilot, lambda: not app.switching, timeout=10, what="the switch to end")
        assert engine.settings["asked"] == ["heads", "ngram+heads", "eagle", "draft-model", "none", "ngram"]
        assert app.settings.drafter == "ngram"
        errors = [n.message for n in app._notifications if n.severity == "error"]
        assert len(errors) == 2 and all("no trained draft heads" in e for e in errors)
