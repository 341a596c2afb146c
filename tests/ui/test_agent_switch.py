"""An agent script that asks for other weights / KV than the chats run: the app switches them as F3 / F4 do (the
progress bar, a first quantization's note, Esc stops it, a second switch or a model switch waits), and the script
starts only once every switch has succeeded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual.widgets import Label, ProgressBar

from specchat.errors import ConfigError
from specchat.ui.app import SpecchatApp
from specchat.ui.controls import ControlsPanel
from specchat.ui.memory import MemoryPanel
from specchat.ui.screens import AgentSettingsScreen
from tests.ui.conftest import SIZE, press_now, wait_for
from tests.ui.test_agent_view import ScriptedUIEngine, call, run_panes, script_dialog

LINEARS = 100


class QuantizingUIEngine(ScriptedUIEngine):
    """Canned agent replies on a model with no MXFP4 checkpoint cached: a switch to MXFP4 reports GPTQ progress over
    LINEARS linears, one every 20 ms once the test lets it begin, until done, stopped (its progress callback
    raises) or `fail` says it fails."""

    def __init__(self, replies: list, fail: Exception | None = None) -> None:
        super().__init__(replies)
        self.begin = threading.Event()
        self.fail = fail
        self.ended: str | None = None  # "done" | the exception that ended the quantization

    def memory(self) -> dict:
        quantized = ("weights", "mxfp4") in self.switched
        return {**super().memory(), "linear_weight_bytes_bf16": 230_000_000, "weights_mxfp4_needs_gptq": not quantized}

    def set_weights(self, fmt: str, progress=None) -> None:
        self.begin.wait(timeout=30)
        try:
            for done in range(1, LINEARS + 1):
                time.sleep(0.02)
                progress("GPTQ", done, LINEARS)
                if self.fail is not None and done == LINEARS // 2:
                    raise self.fail
        except Exception as exc:
            self.ended = type(exc).__name__
            raise
        self.ended = "done"
        super().set_weights(fmt, progress)


def mxfp4_script(tmp_path: Path) -> Path:
    path = tmp_path / "quantized.toml"
    path.write_text(
        'tasks = ["What is 2 + 2?"]\nsystem_prompt = "Use tools."\nmax_steps = 3\nweights = "mxfp4"\n'
        '[tools]\nenabled = ["python", "final_answer"]\n'
    )
    return path


async def choose_the_scripts_settings(pilot, app: SpecchatApp, script: Path) -> None:
    """Run the script from the palette once the engine's figures are in, and answer its settings question with
    Enter (switch to the script's)."""
    await wait_for(pilot, lambda: app.main.query_one(MemoryPanel).memory, timeout=10, what="the engine's figures")
    (await script_dialog(pilot, app)).value = str(script)
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, AgentSettingsScreen), what="the settings question")
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.switching, timeout=10, what="the switch to start")


def note(app: SpecchatApp) -> str:
    label = app.main.query_one(ControlsPanel).query_one("#switch-note", Label)
    return str(label.render()) if label.display else ""


def notes(app: SpecchatApp, severity: str) -> list[str]:
    return [n.message for n in app._notifications if n.severity == severity]


async def test_a_scripts_switch_runs_as_f3s_and_esc_stops_it_without_starting_the_script(tmp_path, store):
    """The script's switch called the engine's setter in a thread of its own: a first MXFP4 switch quantized for
    minutes with no note, no progress, no Esc, F3 and Switch model did not know it ran, and the script started
    even after it failed."""
    engine = QuantizingUIEngine([call("final_answer", answer="4")])
    app = SpecchatApp(engine=engine, store=store, transcript_dir=tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await choose_the_scripts_settings(pilot, app, mxfp4_script(tmp_path))
            assert app.switching == {"weights": "mxfp4"} and not app.agent_sessions
            assert [n.title for n in app._notifications].count("Quantizing to MXFP4") == 1
            assert note(app).startswith("quantizing to MXFP4, once: ")
            assert app.main.query_one(ControlsPanel).query(ProgressBar)
            await pilot.press("f3")  # the app knows a switch runs: a second one is refused
            await app.switch_model("another-model")  # and so is a model switch
            await pilot.pause()
            assert notes(app, "warning") == [
                "weights: still quantizing to mxfp4 (Esc stops it)",
                "weights still changing: switch the model once that is done, or Esc stops the quantization",
            ]
            engine.begin.set()
            await wait_for(pilot, lambda: "left" in note(app), timeout=10, what="the time left")
            press_now(app, "escape")
            await wait_for(pilot, lambda: not app.switching, timeout=10, what="the switch to end")
            await pilot.pause(0.2)
            assert engine.ended == "SwitchStopped" and engine.switched == [] and app.settings.weights is None
            assert not app.agent_sessions and not run_panes(app)
            stopped = [n for n in app._notifications if "not started" in n.message]
            assert [n.message for n in stopped] == [
                "quantized.toml not started: weights: quantizing to mxfp4 stopped; nothing changed"
            ]
            assert not notes(app, "error") and app.chat is not None and app.is_running
    finally:
        engine.begin.set()


async def test_a_script_starts_only_once_its_switch_succeeded(tmp_path, store):
    """A switch that failed was a notification, and the script started all the same on the other weights."""
    engine = QuantizingUIEngine([call("final_answer", answer="4")], fail=ConfigError("no room for the MXFP4 copy"))
    app = SpecchatApp(engine=engine, store=store, transcript_dir=tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await choose_the_scripts_settings(pilot, app, mxfp4_script(tmp_path))
            engine.begin.set()
            await wait_for(pilot, lambda: not app.switching, timeout=10, what="the switch to fail")
            await pilot.pause(0.2)
            assert engine.ended == "ConfigError" and not app.agent_sessions and not run_panes(app)
            assert notes(app, "error") == ["quantized.toml not started: weights: no room for the MXFP4 copy"]
            assert app.settings.weights is None and app.chat is not None and app.is_running

            engine.fail = None  # the same script again, on a switch that works: it runs on MXFP4 weights
            await choose_the_scripts_settings(pilot, app, mxfp4_script(tmp_path))
            await wait_for(pilot, lambda: app.agent_sessions, timeout=10, what="the script to start")
            assert engine.ended == "done" and engine.switched == [("weights", "mxfp4")]
            assert app.settings.weights == "mxfp4" and not app.switching
            await wait_for(pilot, lambda: app.agent_sessions[0].summary, what="the run")
            assert run_panes(app)[0].answer == "4"
    finally:
        engine.begin.set()


async def test_a_script_waits_for_a_weights_switch_that_runs(tmp_path, store):
    """A script started while F3 quantized was compared with the weights the Controls showed, not the ones the
    engine was switching to: it started at once on bf16 and went on on MXFP4 once the quantization ended, its
    status line naming weights it no longer ran on."""
    engine = QuantizingUIEngine([call("final_answer", answer="4")])
    app = SpecchatApp(engine=engine, store=store, transcript_dir=tmp_path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.main.query_one(MemoryPanel).memory, timeout=10, what="the figures")
            await pilot.press("f3")
            await wait_for(pilot, lambda: app.quantizing is not None, timeout=10, what="the quantization")
            script = tmp_path / "as_loaded.toml"  # weights auto: the model as loaded, bf16
            script.write_text('tasks = ["What is 2 + 2?"]\n[tools]\nenabled = ["python", "final_answer"]\n')
            (await script_dialog(pilot, app)).value = str(script)
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert not app.agent_sessions and not run_panes(app) and app.switching == {"weights": "mxfp4"}
            assert notes(app, "warning") == [
                "as_loaded.toml not started: weights still changing: run it once that is done, or Esc stops the "
                "quantization"
            ]
            engine.begin.set()
            await wait_for(pilot, lambda: app.settings.weights == "mxfp4", timeout=10, what="the switch")
            assert app.chat is not None and app.is_running
    finally:
        engine.begin.set()
