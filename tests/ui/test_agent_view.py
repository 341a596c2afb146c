"""The agent view: runs in tabs with their live traces, Esc stops them, shell commands ask through a dialog.

Most tests drive the app with canned replies (tests/agent/scripted_engine.py: the loop's logic is tested there,
the view here); the last ones run the real engine, loaded behind the loading notice, so that the panels read
its steps.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from textual.app import App
from textual.widgets import Input

import specchat.ui
import specchat.ui.agent_runs
from specchat.agent.script import load_script
from specchat.agent.trace import Error, Final, RunEnd, RunStart, Step, ToolCallEvent, ToolResultEvent
from specchat.config import EngineConfig
from specchat.engine.telemetry import EngineMetrics, Snapshot
from specchat.ui.agent import AgentApp
from specchat.ui.agent_runs import AgentTabs
from specchat.ui.agent_view import (
    RESULT_LINES,
    AgentRunPane,
    AgentScriptScreen,
    AnswerView,
    ErrorView,
    ScriptPaths,
    ShellConfirmScreen,
    StepView,
    ToolCallView,
    ToolResultView,
)
from specchat.ui.app import SpecchatApp
from specchat.ui.loading import LoadingNotice
from specchat.ui.messages import LoadProgress
from specchat.ui.screens import AgentSettingsScreen
from specchat.ui.speculation import SpeculationPanel
from tests.agent.scripted_engine import HANG, ScriptedEngine
from tests.conftest import save_tiny_hf
from tests.ui.conftest import SIZE, press_now, wait_for

PYTHON_CALL = '<tool_call>[{"name": "python", "arguments": {"code": "print(17 * 23)"}}]</tool_call>'
LONG_CALL = '<tool_call>[{"name": "python", "arguments": {"code": "for i in range(30): print(i)"}}]</tool_call>'


def call(name: str, **arguments: str) -> str:
    """A Hermes-style tool call, as the model would write it."""
    inner = ", ".join(f'"{key}": "{value}"' for key, value in arguments.items())
    return f'<tool_call>[{{"name": "{name}", "arguments": {{{inner}}}}}]</tool_call>'


class ScriptedUIEngine(ScriptedEngine):
    """Canned replies, plus what the app needs of an engine (engine.api.ChatEngine; no step events: the panels
    stay n/a)."""

    model_spec = None
    device = torch.device("cpu")

    def __init__(self, replies: list) -> None:
        super().__init__(replies)
        self.listeners: list = []
        self.switched: list[tuple[str, str]] = []
        self.running_in_background = False
        self.metrics = EngineMetrics()

    def start(self) -> None:
        self.running_in_background = True

    def close(self) -> None:
        self.running_in_background = False

    def cancel(self, request_id: int) -> None:
        """Chat requests only; agent runs cancel through their handles."""

    def set_k(self, k: int | None, request_id: int | None = None) -> None:
        """K does not matter to canned replies."""

    def set_drafter(self, name: str, request_id: int | None = None) -> None:
        """Nor does the drafter."""

    def set_weights(self, fmt: str, progress=None) -> None:
        """Nor the weights; the switches are recorded."""
        self.switched.append(("weights", fmt))

    def set_kv(self, fmt: str) -> None:
        """Nor the KV format."""
        self.switched.append(("kv", fmt))

    def resolve_formats(self, weights: str = "auto", kv: str = "auto") -> tuple[str, str]:
        return ("bf16" if weights == "auto" else weights), ("bf16" if kv == "auto" else kv)

    def apply(self, command) -> Future:
        done: Future = Future()
        command()
        done.set_result(None)
        return done

    def snapshot(self) -> Snapshot:
        return self.metrics.snapshot(0, 0, self.memory())


def write_script(tmp_path: Path, tasks: list[str], tools: str = '["python", "final_answer"]', extra: str = "") -> Path:
    path = tmp_path / "agent.toml"
    head = f'tasks = {json.dumps(tasks)}\nsystem_prompt = "Use tools."\nmax_steps = 3\n'
    path.write_text(f"{head}[tools]\nenabled = {tools}\n{extra}")
    return path


def agent_app(engine, script: Path, tmp_path: Path, store, concurrency: int | None = 1) -> AgentApp:
    return AgentApp(
        load_script(script), EngineConfig(), concurrency, engine=engine, store=store, transcript_dir=tmp_path
    )


def run_panes(app: SpecchatApp) -> list[AgentRunPane]:
    return list(app.main.query(AgentRunPane))


def tab_label(app: SpecchatApp, pane: AgentRunPane) -> str:
    return str(app.main.query_one("TabbedContent").get_tab(pane.parent.id).label)


def texts(pane: AgentRunPane, kind: type) -> list[str]:
    return [str(view.render()) for view in pane.query(kind)]


async def session_over(pilot, app: SpecchatApp, tabs: AgentTabs, timeout: float = 60.0) -> None:
    await wait_for(pilot, lambda: tabs.summary is not None, timeout=timeout, what="the end of the session")
    await wait_for(pilot, lambda: not app.workers, timeout=timeout, what="the session's worker")


async def test_runs_appear_in_tabs_with_their_trace(tmp_path, store):
    final = call("final_answer", answer="391")
    engine = ScriptedUIEngine([PYTHON_CALL, final, call("final_answer", answer="6912")])
    app = agent_app(engine, write_script(tmp_path, ["What is 17 * 23?", "What is 1234 + 5678?"]), tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and len(run_panes(app)) == 2, what="the run tabs")
        tabs = app.agent_sessions[0]
        await session_over(pilot, app, tabs)
        first, second = run_panes(app)
        assert app.main.query_one("TabbedContent").active == first.parent.id
        assert first.agent_task == "What is 17 * 23?" and second.agent_task == "What is 1234 + 5678?"
        steps = texts(first, StepView)
        assert steps[0].startswith("step 1 · ") and steps[0].endswith(PYTHON_CALL)
        assert texts(first, ToolCallView)[0] == '→ python\ncode = "print(17 * 23)"'
        assert texts(first, ToolResultView)[0] == "← python ok\n391"
        assert texts(first, AnswerView) == ["answer (final_answer)\n391"]
        assert (first.state, first.answer, second.answer) == ("final", "391", "6912")
        assert "final after 2 steps" in str(first.query_one(".run-status").render())
        assert tab_label(app, first) == "✓ 1: What is 17 * 23?"
        assert tabs.summary.reasons == {"final": 2}
        await wait_for(pilot, lambda: any("2 runs (2 final)" in n.message for n in app._notifications))


async def test_a_long_tool_result_is_folded_until_expanded(tmp_path, store):
    engine = ScriptedUIEngine([LONG_CALL, call("final_answer", answer="done")])
    app = agent_app(engine, write_script(tmp_path, ["Count to 30."]), tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, what="the run")
        result = run_panes(app)[0].query_one(ToolResultView)
        folded = str(result.render()).splitlines()
        assert folded[1 : RESULT_LINES + 1] == [str(i) for i in range(RESULT_LINES)]
        assert folded[-1].startswith(f"… {30 - RESULT_LINES} more lines")
        await pilot.pause()  # the trace's layout settles before the click lands on the result
        await pilot.click(result)
        assert str(result.render()).splitlines()[1:31] == [str(i) for i in range(30)]
        assert result.has_focus
        await pilot.press("enter")
        assert str(result.render()).splitlines() == folded


async def test_escape_stops_the_runs(tmp_path, store):
    engine = ScriptedUIEngine([HANG, HANG])
    app = agent_app(engine, write_script(tmp_path, ["Wait.", "Wait too."]), tmp_path, store, concurrency=2)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: [p.state for p in run_panes(app)] == ["running"] * 2, what="both runs")
        press_now(app, "escape")
        tabs = app.agent_sessions[0]
        await session_over(pilot, app, tabs)
        assert [p.state for p in run_panes(app)] == ["cancelled"] * 2
        assert tab_label(app, run_panes(app)[1]) == "■ 2: Wait too."
        assert "cancelled after 1 step " in str(run_panes(app)[0].query_one(".run-status").render())


class BrokenUIEngine(ScriptedUIEngine):
    """Canned replies until the second turn, whose prompt fails with what is not a SpecchatError (our bug, say)."""

    def encode_prompt(self, messages: list[dict], tools=None) -> list[int]:
        if self.requests:
            raise RuntimeError("the tokenizer broke")
        return super().encode_prompt(messages, tools)


async def test_a_session_that_raises_ends_its_open_runs_and_the_app_goes_on(tmp_path, store):
    """An exception other than SpecchatError out of AgentSession ended the app (the worker's error), or left the
    run's tab running for good; now the run ends with it in its tab, after what it did before."""
    engine = BrokenUIEngine([PYTHON_CALL])
    app = agent_app(engine, write_script(tmp_path, ["What is 17 * 23?"]), tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].over, what="the session to end")
        await wait_for(pilot, lambda: not app.workers, what="the session's worker")
        (first,) = run_panes(app)
        assert texts(first, ToolResultView) == ["← python ok\n391"]  # what the run did before stays
        assert texts(first, ErrorView) == ["fatal: RuntimeError: the tokenizer broke"]
        assert first.state == "error" and tab_label(app, first) == "✗ 1: What is 17 * 23?"
        assert str(first.query_one(".run-status").render()) == "error: the agent session failed before this run ended"
        assert [n.title for n in app._notifications if n.severity == "error"] == ["agent script 1 failed"]
        press_now(app, "ctrl+pageup")
        await wait_for(pilot, lambda: app.chat is not None, what="back to the chat")
        assert app.is_running and app.return_value is None


async def test_a_session_that_cannot_start_ends_its_queued_runs(tmp_path, store, monkeypatch):
    """A session that fails to be made (an OSError building its toolbox, say) left every tab queued for good, and
    a model switch refused as if runs were going on."""

    def no_session(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/work/space")

    monkeypatch.setattr(specchat.ui.agent_runs, "AgentSession", no_session)
    app = agent_app(ScriptedUIEngine([]), write_script(tmp_path, ["One.", "Two."]), tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].over, what="the session to end")
        problem = "PermissionError: [Errno 13] Permission denied: '/work/space'"
        for pane in run_panes(app):
            assert pane.state == "error" and texts(pane, ErrorView) == [f"fatal: {problem}"]
        assert app.is_running


async def test_specchat_agent_runs_its_script_once_a_model_switch_does_not_run_it_again(tmp_path, store):
    """`specchat agent SCRIPT` started the script on every engine it attached: Switch model, once the runs were over,
    ran every task again on the new model, in new tabs (their shell commands asking again), and so did the previous
    model coming back after a switch that failed."""
    loaded: list[str] = []

    def loader(config: EngineConfig, progress) -> ScriptedUIEngine:
        loaded.append(config.model)
        return ScriptedUIEngine([call("final_answer", answer="again")])

    script = load_script(write_script(tmp_path, ["What is 2 + 2?"]))
    engine = ScriptedUIEngine([call("final_answer", answer="4")])
    app = AgentApp(script, EngineConfig(model="tiny"), 1, engine=engine, store=store, loader=loader)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, what="the run")
        await wait_for(pilot, lambda: not app.workers, what="the session's worker")
        await app.switch_model("smollm2-360m")
        await wait_for(pilot, lambda: loaded and app.engine is not None, what="the new model")
        await pilot.pause(0.2)
        assert len(app.agent_sessions) == 1 and [pane.answer for pane in run_panes(app)] == ["4"]
        assert app.is_running


SHELL_TOOLS = '["shell", "final_answer"]'
SHELL_OPTIONS = '[tools.shell]\nallow = ["echo"]\n'


async def test_shell_commands_ask_and_do_what_the_answer_says(tmp_path, store):
    replies = [call("shell", command="echo allowed"), call("final_answer", answer="ok")]
    replies += [call("shell", command="echo refused"), call("final_answer", answer="no")]
    script = write_script(tmp_path, ["Say allowed.", "Say refused."], SHELL_TOOLS, SHELL_OPTIONS)
    app = agent_app(ScriptedUIEngine(replies), script, tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        for key, command in (("y", "echo allowed"), ("n", "echo refused")):
            await wait_for(pilot, lambda: isinstance(app.screen, ShellConfirmScreen), what="the shell question")
            dialog = app.screen
            assert dialog.command == command
            assert dialog.asker.startswith(f"agent script 1, run {1 if key == 'y' else 2}: Say")
            await pilot.press(key)
        tabs = app.agent_sessions[0]
        await session_over(pilot, app, tabs)
        allowed, refused = (texts(pane, ToolResultView)[0] for pane in run_panes(app))
        assert allowed == "← shell ok\nallowed"
        assert refused == "← shell error: the user did not allow this command"


async def test_closing_the_app_refuses_an_open_question(tmp_path, store):
    script = write_script(tmp_path, ["Say hi."], SHELL_TOOLS, SHELL_OPTIONS)
    app = agent_app(ScriptedUIEngine([call("shell", command="echo hi")]), script, tmp_path, store)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ShellConfirmScreen), what="the shell question")
        tabs = app.agent_sessions[0]
        question = app.shell_asking
    assert question.answer.result(timeout=5) is False
    tabs.session.cancelled.wait(timeout=5)
    assert tabs.session.cancelled.is_set()


async def script_dialog(pilot, app: SpecchatApp) -> Input:
    """Open the palette's script dialog and wait for its input to take the keys."""
    app.action_run_agent()
    await wait_for(pilot, lambda: isinstance(app.screen, AgentScriptScreen) and app.screen.query(Input))
    field = app.screen.query_one(Input)
    await wait_for(pilot, lambda: field.has_focus, what="the path field")
    return field


async def test_the_palette_runs_a_script_in_new_tabs(tmp_path, store):
    engine = ScriptedUIEngine([call("final_answer", answer="4")])
    script = write_script(tmp_path, ["What is 2 + 2?"])
    app = SpecchatApp(engine=engine, store=store, transcript_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        assert "Run agent script" in {c.title for c in app.get_system_commands(app.screen)}
        await script_dialog(pilot, app)
        await pilot.press(*"nothing.toml", "enter")
        await wait_for(pilot, lambda: any("no such file" in n.message for n in app._notifications))
        (await script_dialog(pilot, app)).value = str(script)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, what="the run")
        pane = run_panes(app)[0]
        assert pane.answer == "4" and app.chat is None  # the run's tab is shown, beside the chat's
        assert len(app.main.query("TabPane")) == 2
        press_now(app, "ctrl+pageup")
        await wait_for(pilot, lambda: app.chat is not None, what="back to the chat")


@pytest.mark.parametrize(("key", "switched"), [("enter", [("weights", "bf16")]), ("k", [])])
async def test_a_script_asks_before_it_changes_the_chats_weights(tmp_path, store, key, switched):
    """The chat runs MXFP4 weights, the script its own (auto: as loaded): Enter switches the engine to the
    script's, K keeps the chat's; either way the runs start (issue 15)."""
    engine = ScriptedUIEngine([call("final_answer", answer="4")])
    script = write_script(tmp_path, ["What is 2 + 2?"])
    app = SpecchatApp(engine=engine, store=store, transcript_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        app.settings.weights = "mxfp4"
        (await script_dialog(pilot, app)).value = str(script)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, AgentSettingsScreen), what="the settings question")
        assert "weights bf16 and KV bf16" in app.screen.text and "weights mxfp4 and KV bf16" in app.screen.text
        await pilot.press(key)
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, what="the run")
        assert engine.switched == switched and run_panes(app)[0].answer == "4"


@pytest.fixture
def script_tree(tmp_path: Path, monkeypatch) -> Path:
    """A working directory with example agent scripts and one of the user's own."""
    for name in ("examples/agents/arithmetic.toml", "examples/agents/find_fact.toml", "mine/task.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "mine" / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def test_script_paths_complete_relative_and_absolute(script_tree):
    paths = ScriptPaths(["examples/agents/arithmetic.toml", "examples/agents/find_fact.toml"])
    assert await paths.get_suggestion("e") == "examples/agents/arithmetic.toml"
    assert await paths.get_suggestion("examples/agents/f") == "examples/agents/find_fact.toml"
    assert await paths.get_suggestion("mi") == "mine/"
    assert await paths.get_suggestion("mine/") == "mine/task.toml"  # not notes.txt
    assert await paths.get_suggestion(f"{script_tree}/mine/t") == f"{script_tree}/mine/task.toml"
    assert await paths.get_suggestion("nowhere/x") is None


async def test_the_script_dialog_completes_a_relative_path(script_tree):
    app = SpecchatApp(engine=ScriptedUIEngine([]))
    async with app.run_test(size=SIZE) as pilot:
        field = await script_dialog(pilot, app)
        await pilot.press(*"mine/t")
        await wait_for(pilot, lambda: field._suggestion == "mine/task.toml", what="the suggestion")
        await pilot.press("right")
        assert field.value == "mine/task.toml"
        assert field.placeholder == "examples/agents/arithmetic.toml"


@pytest.fixture
def agent_model_dir(tmp_path: Path) -> Path:
    """A tiny random model with room for an agent's prompt (the tools are listed in it: ~300 tokens)."""
    return save_tiny_hf(tmp_path / "tiny-agent", {"max_position_embeddings": 1024})


async def test_loads_behind_the_notice_and_feeds_the_panels(agent_model_dir, tmp_path, store):
    """A random model cannot answer, but a guided first turn makes it call a tool: the trace shows the call and
    its result, and the Speculation panel shows the engine's steps."""
    script = write_script(
        tmp_path,
        ["What is 17 * 23?"],
        '["python"]',
        '[sampling]\nmax_tokens = 8\n[speculation]\ndrafter = "ngram"\nk = 3\n',
    )
    script.write_text('tool_choice = "first"\n' + script.read_text().replace("max_steps = 3", "max_steps = 1"))
    config = EngineConfig(model=str(agent_model_dir), device="cpu", dtype="float32")
    app = AgentApp(load_script(script), config, store=store, transcript_dir=tmp_path)
    notices: list[int] = []  # loading notices on screen when each progress message arrived
    hook = lambda message: isinstance(message, LoadProgress) and notices.append(len(app.main.query(LoadingNotice)))
    async with app.run_test(size=SIZE, message_hook=hook) as pilot:
        await wait_for(pilot, lambda: app.engine is not None and not app.main.query(LoadingNotice), what="load")
        assert notices and set(notices) == {1}
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, timeout=120)
        pane = run_panes(app)[0]
        assert pane.state == "max_steps"
        (called,), (answered,) = texts(pane, ToolCallView), texts(pane, ToolResultView)
        name = called.splitlines()[0].removeprefix("→ ")  # a random model names a random tool
        assert answered.startswith(f"← {name} error: unknown tool")
        await wait_for(pilot, lambda: app.metrics.steps > 0, what="the engine's steps")
        headline = app.main.query_one(SpeculationPanel).query_one(".headline")
        await wait_for(pilot, lambda: "tokens/step  n/a" not in str(headline.render()), what="the panel")
        await wait_for(pilot, lambda: not app.workers, what="the session's worker")


@pytest.mark.slow
async def test_the_default_model_answers_in_its_tab(default_engine, tmp_path, store):
    example = Path(__file__).parents[2] / "examples" / "agents" / "arithmetic.toml"
    script = dataclasses.replace(load_script(example), tasks=["What is 17 * 23?"])
    app = AgentApp(script, EngineConfig(), engine=default_engine, store=store, transcript_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.agent_sessions and app.agent_sessions[0].summary, timeout=300)
        pane = run_panes(app)[0]
        assert texts(pane, ToolCallView)[0] == '→ python\ncode = "print(17 * 23)"'
        assert texts(pane, ToolResultView)[0] == "← python ok\n391"
        assert (pane.state, pane.answer) == ("final", "391")
        assert app.metrics.total_tokens > 0 and app.metrics.view().acceptance_now is not None
        await wait_for(pilot, lambda: not app.workers, what="the session's worker")


SNAPSHOT_EVENTS = [
    RunStart(0, "Sum the squares of 1 to 12.", "smollm2-135m", "ngram", 4, ["python"], 4),
    Step(0, 1, LONG_CALL, 21, "stop", 1.2, {"tokens_per_step": 2.62, "drafted": 24, "acceptance_rate": 0.54}),
    ToolCallEvent(
        0, 1, "c1", "python", {"code": "total = 0\nfor i in range(1, 13):\n    total += i * i\nprint(total)"}
    ),
    ToolResultEvent(0, 1, "c1", "python", True, "\n".join(str(i) for i in range(12)) + "\n650"),
    Error(0, 2, "the tool call could not be parsed: the JSON is cut off"),
    Step(0, 2, "The answer is 650.", 6, "stop", 2.0, {"tokens_per_step": 1.5, "drafted": 8, "acceptance_rate": 0.25}),
    Final(0, 2, "650", "regex"),
    RunEnd(0, "final", 2, 27, 2.0, "650", {"tokens_per_step": 2.25, "drafted": 32, "acceptance_rate": 0.47}),
]


class RunPaneApp(App):
    """One run's pane, fed fixed events."""

    CSS_PATH = Path(specchat.ui.__file__).parent / "specchat.tcss"
    AUTO_FOCUS = None

    def compose(self):
        yield AgentRunPane(0, "Sum the squares of 1 to 12.")

    async def on_mount(self) -> None:
        await self.query_one(AgentRunPane).show(SNAPSHOT_EVENTS)


def test_run_pane_snapshot(snap_compare):
    assert snap_compare(RunPaneApp(), terminal_size=(90, 44))


def test_an_agent_app_that_ends_in_an_exception_ends_the_command_with_status_1(tmp_path, monkeypatch):
    """A bug that ended the agent TUI in an exception printed Textual's traceback, and `specchat agent` exited 0."""
    from specchat.ui.agent import run_agent_app
    from tests.ui.conftest import crash_on_mount

    crash_on_mount(monkeypatch, AgentApp, tmp_path)
    with pytest.raises(SystemExit) as ended:
        run_agent_app(load_script(write_script(tmp_path, ["What is 2 + 2?"])), EngineConfig(model="smollm2-135m"), 1)
    assert ended.value.code == 1
