"""The agent loop's logic against canned replies: answers, tool results, errors, nudges, limits, cancellation."""

import threading
import time
from pathlib import Path

import pytest

from specchat.agent.runner import AgentSession
from specchat.agent.script import load_script
from specchat.agent.trace import (
    Delta,
    Error,
    Final,
    RunEnd,
    RunStart,
    SessionEnd,
    Step,
    ToolCallEvent,
    ToolResultEvent,
)
from specchat.errors import SpecchatError
from tests.agent.scripted_engine import HANG, ScriptedEngine

STRUCTURED_TEMPLATE = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
PYTHON_CALL = '<tool_call>[{"name": "python", "arguments": {"code": "print(17 * 23)"}}]</tool_call>'
FINAL_CALL = '<tool_call>[{"name": "final_answer", "arguments": {"answer": "391"}}]</tool_call>'


def write_script(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(
        'tasks = ["What is 17 * 23?"]\nsystem_prompt = "Use tools."\nmax_steps = 3\n'
        + body
        + '\n[tools]\nenabled = ["python", "final_answer"]\n'
        # the loop's logic is under test, not the sandbox: run python where user namespaces are missing too
        + "[tools.python]\nallow_unsandboxed = true\n"
    )
    return path


def run(engine: ScriptedEngine, path: Path, **session_options) -> tuple[list, list]:
    events = []
    outcomes = AgentSession(engine, load_script(path), **session_options).run(events.append)
    return outcomes, events


def test_tool_call_then_final_answer(tmp_path):
    engine = ScriptedEngine([PYTHON_CALL, FINAL_CALL])
    outcomes, events = run(engine, write_script(tmp_path))
    assert [type(e).__name__ for e in events] == [
        "RunStart",
        "Step",
        "ToolCallEvent",
        "ToolResultEvent",
        "Step",
        "ToolCallEvent",
        "ToolResultEvent",
        "Final",
        "RunEnd",
        "SessionEnd",
    ]
    assert events[3].ok and events[3].content == "391\n"
    assert (outcomes[0].reason, outcomes[0].answer, outcomes[0].steps) == ("final", "391", 2)
    first, second = engine.requests
    assert first["tools"] is None  # ChatML ignores tools=: they are listed in the system prompt instead
    assert '"name": "python"' in first["messages"][0]["content"] and "<tools>" in first["messages"][0]["content"]
    assert second["messages"][-2] == {"role": "assistant", "content": PYTHON_CALL}
    assert second["messages"][-1] == {"role": "user", "content": "<tool_response>\n391\n\n</tool_response>"}
    end = events[-2]
    assert isinstance(end, RunEnd) and end.answer == "391"
    assert end.tokens == len(PYTHON_CALL.split()) + len(FINAL_CALL.split())  # one token per word here
    assert end.stats["tokens_per_step"] == 2.0 and end.stats["prompt_tokens"] == 40


def test_structured_template_gets_tools_and_tool_messages(tmp_path):
    engine = ScriptedEngine([PYTHON_CALL, FINAL_CALL], chat_template=STRUCTURED_TEMPLATE)
    run(engine, write_script(tmp_path))
    first, second = engine.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["python", "final_answer"]
    assert first["messages"][0]["content"] == "Use tools."
    assistant, tool = second["messages"][-2:]
    assert assistant["tool_calls"][0]["function"] == {"name": "python", "arguments": {"code": "print(17 * 23)"}}
    assert tool == {"role": "tool", "tool_call_id": "c00010000", "name": "python", "content": "391\n"}


def test_malformed_call_goes_back_and_the_loop_goes_on(tmp_path):
    engine = ScriptedEngine(['<tool_call>{"name": "python", "arguments": {"code": "print(', FINAL_CALL])
    outcomes, events = run(engine, write_script(tmp_path))
    errors = [e for e in events if isinstance(e, Error)]
    assert len(errors) == 1 and not errors[0].fatal and "cut off" in errors[0].message
    feedback = engine.requests[1]["messages"][-1]
    assert feedback["role"] == "user" and "could not be parsed" in feedback["content"]
    assert outcomes[0].reason == "final"


def test_bad_arguments_come_back_as_an_error_result(tmp_path):
    bad = '<tool_call>{"name": "python", "arguments": {"answer": "17"}}</tool_call>'
    engine = ScriptedEngine([bad, FINAL_CALL])
    _, events = run(engine, write_script(tmp_path))
    result = events[3]
    assert not result.ok and "unknown argument 'answer'" in result.error
    assert "Error: unknown argument 'answer'" in engine.requests[1]["messages"][-1]["content"]


def test_an_empty_final_answer_goes_back_and_the_run_goes_on(tmp_path):
    empty = '<tool_call>{"name": "final_answer", "arguments": {"answer": " "}}</tool_call>'
    engine = ScriptedEngine([empty, FINAL_CALL])
    outcomes, events = run(engine, write_script(tmp_path))
    result = events[3]
    assert isinstance(result, ToolResultEvent) and not result.ok and "is empty" in result.error
    assert "Error: argument 'answer' of final_answer is empty" in engine.requests[1]["messages"][-1]["content"]
    assert [e.answer for e in events if isinstance(e, Final)] == ["391"]
    assert (outcomes[0].reason, outcomes[0].answer, outcomes[0].steps) == ("final", "391", 2)


def test_a_reply_past_what_json_decodes_goes_back_and_the_run_goes_on(tmp_path):
    """A reply with a 5000-digit number raised ValueError out of the run's thread, and the session ended in a
    traceback with no run_end or session_end."""
    digits = '<tool_call>{"name": "python", "arguments": {"code": ' + "9" * 5000 + "}}</tool_call>"
    engine = ScriptedEngine([digits, FINAL_CALL])
    outcomes, events = run(engine, write_script(tmp_path))
    errors = [e for e in events if isinstance(e, Error)]
    assert len(errors) == 1 and not errors[0].fatal and "more than 4300 digits" in errors[0].message
    assert (outcomes[0].reason, outcomes[0].answer) == ("final", "391")
    assert isinstance(events[-1], SessionEnd)


def test_reply_without_a_call_is_nudged_until_max_steps(tmp_path):
    engine = ScriptedEngine(["It is 391.", "Still 391.", "391!"])
    outcomes, _ = run(engine, write_script(tmp_path))
    assert outcomes[0].reason == "max_steps" and outcomes[0].steps == 3
    nudge = engine.requests[1]["messages"][-1]["content"]
    assert "no tool call" in nudge and "call final_answer" in nudge and "<tool_call>" in nudge
    roles = [m["role"] for m in outcomes[0].messages]
    assert roles == ["system", "user", *["assistant", "user"] * 3]


def test_tool_result_and_parse_errors_share_one_user_turn(tmp_path):
    engine = ScriptedEngine([PYTHON_CALL + '<tool_call>{"name": "python"', FINAL_CALL])
    run(engine, write_script(tmp_path))
    last = engine.requests[1]["messages"][-1]
    assert last["role"] == "user" and engine.requests[1]["messages"][-2]["role"] == "assistant"
    assert last["content"].startswith("<tool_response>\n391") and "could not be parsed" in last["content"]


def test_tag_stop_takes_the_answer_from_the_reply(tmp_path):
    engine = ScriptedEngine(["Let me see. <final>391</final>"])
    path = write_script(tmp_path, '\n[stop]\ntag = "final"\n')
    outcomes, events = run(engine, path)
    final = next(e for e in events if isinstance(e, Final))
    assert (final.answer, final.source) == ("391", "tag")
    assert outcomes[0].reason == "final"


def test_an_empty_tag_or_regex_answer_is_nudged_not_final(tmp_path):
    """`<final> </final>` ended the run as final with an empty answer, where final_answer("") is refused."""
    for stop, empty, full in (
        ('tag = "final"', "<final> </final>", "<final>391</final>"),
        ('regex = "A: (.*)"', "A: ", "A: 391"),
    ):
        engine = ScriptedEngine([empty, full])
        outcomes, events = run(engine, write_script(tmp_path, f"\n[stop]\n{stop}\n"))
        assert [e.answer for e in events if isinstance(e, Final)] == ["391"]
        assert (outcomes[0].reason, outcomes[0].answer, outcomes[0].steps) == ("final", "391", 2)
        assert "no tool call" in engine.requests[1]["messages"][-1]["content"]


def test_a_reply_that_calls_tools_is_not_final(tmp_path):
    engine = ScriptedEngine([PYTHON_CALL + " <final>349</final>", "<final>391</final>"])
    outcomes, _ = run(engine, write_script(tmp_path, '\n[stop]\ntag = "final"\n'))
    assert (outcomes[0].answer, outcomes[0].steps) == ("391", 2)


def test_wall_time_cancels_the_request_in_flight(tmp_path):
    engine = ScriptedEngine([HANG])
    outcomes, events = run(engine, write_script(tmp_path, "max_wall_s = 0.2\n"))
    assert outcomes[0].reason == "max_wall_s" and outcomes[0].steps == 1
    assert isinstance(events[1], Step) and events[1].finish_reason == "cancelled"


def test_cancel_ends_every_run(tmp_path):
    engine = ScriptedEngine([HANG, HANG])
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["a", "b"]\nconcurrency = 2\n')
    session = AgentSession(engine, load_script(path))
    ends = []
    for event in session.events():
        if isinstance(event, RunStart) and event.run == 1:
            threading.Timer(0.05, session.cancel).start()  # both runs are waiting on the engine by then
        if isinstance(event, RunEnd):
            ends.append(event.reason)
    assert ends == ["cancelled", "cancelled"]


def test_cancel_ends_a_run_blocked_in_a_tool_call(tmp_path):
    """Ctrl-C while a tool runs: the run ends now, not at the tool's timeout (the python call sleeps for 60 s)."""
    sleeping = '<tool_call>[{"name": "python", "arguments": {"code": "import time; time.sleep(60)"}}]</tool_call>'
    engine = ScriptedEngine([sleeping, FINAL_CALL])
    path = write_script(tmp_path)
    path.write_text(path.read_text().replace("[tools]\n", "[tools]\ntimeout_s = 60\n"))
    session = AgentSession(engine, load_script(path))
    started, ends, results = time.monotonic(), [], []
    for event in session.events():
        if isinstance(event, ToolCallEvent):
            threading.Timer(0.3, session.cancel).start()
        if isinstance(event, ToolResultEvent):
            results.append(event.error)
        if isinstance(event, RunEnd):
            ends.append(event.reason)
    assert time.monotonic() - started < 20
    assert results == ["cancelled; the process was killed"] and ends == ["cancelled"]


def test_missing_drafter_falls_back_to_plain_decoding_with_a_warning(tmp_path):
    engine = ScriptedEngine([FINAL_CALL])
    session = AgentSession(engine, load_script(write_script(tmp_path, '\n[speculation]\ndrafter = "ngram"\n')))
    assert "'ngram' is not available" in session.warning and session.spec.drafter == "none"
    events = []
    session.run(events.append)
    assert engine.requests[0]["submits"][0]["spec"].drafter == "none"
    assert isinstance(events[0], RunStart) and events[0].drafter == "none"


def test_concurrent_runs_and_the_session_summary(tmp_path):
    engine = ScriptedEngine([FINAL_CALL, "no idea", "no idea", "no idea"])
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["a", "b"]\nconcurrency = 2\nmax_steps = 2\n')
    outcomes, events = run(engine, path)
    assert sorted(o.reason for o in outcomes) == ["final", "max_steps"]
    summary = events[-1]
    assert isinstance(summary, SessionEnd) and summary.runs == 2
    assert summary.reasons == {"final": 1, "max_steps": 1}
    assert summary.prefix_hit_rate == 0.5  # 10 of every 20 prompt tokens came from the cache
    assert summary.stats["steps"] == 3 and summary.tokens == sum(o.tokens for o in outcomes)


def test_streaming_sessions_emit_deltas(tmp_path):
    engine = ScriptedEngine([FINAL_CALL])
    _, events = run(engine, write_script(tmp_path), stream=True)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert deltas and "".join(d.text for d in deltas) == FINAL_CALL
    assert not [e for e in events if isinstance(e, ToolCallEvent) and e.name != "final_answer"]


REGEX_STOP = "\n[stop]\nregex = '(?im)answer is:? *(.+?)\\.?\\s*$'\n"


def test_a_guided_first_turn_writes_the_structure_and_the_model_the_values(tmp_path):
    engine = ScriptedEngine(['python", "x', 'print(17 * 23)"}', "The answer is 391."])
    outcomes, events = run(engine, write_script(tmp_path, 'tool_choice = "first"\n' + REGEX_STOP))
    assert events[1].text == PYTHON_CALL and events[1].stats["requests"] == 2
    assert [e.content for e in events if type(e).__name__ == "ToolResultEvent"] == ["391\n"]
    assert (outcomes[0].reason, outcomes[0].answer) == ("final", "391")
    name_piece, value_piece = engine.requests[0]["submits"]
    assert name_piece["text"] == '<tool_call>[{"name": "' and name_piece["sampling"].stop == ['"']
    assert value_piece["text"] == '<tool_call>[{"name": "python", "arguments": {"code": "'
    assert len(engine.requests[1]["submits"]) == 1  # "first": later turns are the model's own


def test_a_guided_value_may_hold_escaped_quotes(tmp_path):
    engine = ScriptedEngine(["python", 'print(\\"', 'hi\\"', ')"', "The answer is hi."])
    _, events = run(engine, write_script(tmp_path, 'tool_choice = "first"\n' + REGEX_STOP))
    call = next(e for e in events if isinstance(e, ToolCallEvent))
    assert call.arguments == {"code": 'print("hi")'}


def test_a_guided_name_that_is_no_tool_is_answered_as_an_unknown_tool(tmp_path):
    engine = ScriptedEngine(['17"', FINAL_CALL])
    _, events = run(engine, write_script(tmp_path, 'tool_choice = "first"\n'))
    result = next(e for e in events if type(e).__name__ == "ToolResultEvent")
    assert result.name == "17" and "unknown tool '17'" in result.error


def test_a_guided_call_takes_array_and_object_values_whole(tmp_path):
    """A user tool with a list or dict parameter under tool_choice = "first": its value stopped at the first ',' (as a
    number's does), so `[1, 2, 3]` became `[1`, and every guided call to it was JSON that could not be parsed."""
    (tmp_path / "listy.py").write_text(
        "from specchat.agent import tool\n\n\n@tool\n"
        "def total(values: list[list[float]], scale: dict, label: str) -> float:\n"
        '    """Sum numbers, times scale["k"]."""\n'
        '    return sum(sum(row) for row in values) * scale["k"]\n'
    )
    path = tmp_path / "agent.toml"
    path.write_text(
        'tasks = ["Sum 1, 2 and 3"]\nmax_steps = 2\ntool_choice = "first"\n[tools.user]\nmodule = "listy.py"\n'
    )
    # each piece ends at its stop string: the name; the nested list in three; the object, with a "}" inside a string,
    # in two; the label
    pieces = ['total"', "[1]", ", [2, 3]", "]", '"k": 2, "note": "a }', ' here"}', 'sum"']
    engine = ScriptedEngine([*pieces, FINAL_CALL])
    _, events = run(engine, path)
    call = next(e for e in events if isinstance(e, ToolCallEvent))
    assert call.arguments == {"values": [[1], [2, 3]], "scale": {"k": 2, "note": "a } here"}, "label": "sum"}
    values_piece, *_ = engine.requests[0]["submits"][1:]
    assert values_piece["text"].endswith('"arguments": {"values": [') and values_piece["sampling"].stop == ["]"]
    assert not [e for e in events if isinstance(e, Error)]


def test_worked_examples_come_before_the_task_in_the_run_format(tmp_path):
    examples = (
        '[[examples]]\ntask = "What is 3 * 4?"\nanswer = "The answer is 12."\n'
        'calls = [{ name = "python", arguments = { code = "print(3 * 4)" }, result = "12" }]\n'
    )
    engine = ScriptedEngine(["The answer is 391."])
    run(engine, write_script(tmp_path, examples + REGEX_STOP))
    messages = engine.requests[0]["messages"]
    demo_call = '<tool_call>[{"name": "python", "arguments": {"code": "print(3 * 4)"}}]</tool_call>'
    assert messages[1:] == [
        {"role": "user", "content": "What is 3 * 4?"},
        {"role": "assistant", "content": demo_call},
        {"role": "user", "content": "<tool_response>\n12\n</tool_response>"},
        {"role": "assistant", "content": "The answer is 12."},
        {"role": "user", "content": "What is 17 * 23?"},
    ]


def test_worked_examples_end_in_a_final_answer_call_for_the_tool_stop(tmp_path):
    examples = '[[examples]]\ntask = "What is 3 * 4?"\nanswer = "12"\n'
    engine = ScriptedEngine([FINAL_CALL], chat_template=STRUCTURED_TEMPLATE)
    run(engine, write_script(tmp_path, examples))
    demo = engine.requests[0]["messages"][1:3]
    assert demo[0] == {"role": "user", "content": "What is 3 * 4?"}
    assert demo[1]["tool_calls"][0]["function"] == {"name": "final_answer", "arguments": {"answer": "12"}}


def test_a_workspace_that_cannot_be_made_fails_its_run_not_the_session(tmp_path, monkeypatch):
    """copy_workspace onto a full /tmp: shutil.Error from one run's thread ended the session in a traceback."""
    import contextlib
    import shutil

    (tmp_path / "ws").mkdir()

    @contextlib.contextmanager
    def full_disk(source, copy):
        if copy:
            why = "[Errno 28] No space left on device"
            raise shutil.Error([(str(source / "a"), "/tmp/x/a", why), (str(source / "b"), "/tmp/x/b", why)])
        yield source

    monkeypatch.setattr("specchat.agent.runner.run_workspace", full_disk)
    path = write_script(tmp_path, 'workspace = "ws"\ncopy_workspace = true\n')
    outcomes, events = run(ScriptedEngine([FINAL_CALL]), path)
    assert [outcome.reason for outcome in outcomes] == ["error"]
    [error] = [event for event in events if isinstance(event, Error)]
    assert error.fatal and error.message == (
        "cannot make the run's workspace: [Errno 28] No space left on device (and 1 more files)"
    )
    assert [type(event).__name__ for event in events] == ["RunStart", "Error", "RunEnd", "SessionEnd"]


def test_a_workspace_removed_mid_session_fails_the_runs_after_it_not_the_session(tmp_path):
    """A run's python code deleted the (shared) workspace: the next run's toolbox raised FileNotFoundError from its
    thread, which ended the session in a traceback and lost every later run."""
    (tmp_path / "ws").mkdir()
    path = write_script(tmp_path, 'workspace = "ws"\n')
    path.write_text(path.read_text().replace('tasks = ["What is 17 * 23?"]', 'tasks = ["first", "second"]'))
    remove = '<tool_call>[{"name": "python", "arguments": {"code": "import os, shutil; shutil.rmtree(os.getcwd())"}}]'
    outcomes, events = run(ScriptedEngine([remove + "</tool_call>", FINAL_CALL]), path)
    assert [outcome.reason for outcome in outcomes] == ["final", "error"]
    [error] = [event for event in events if isinstance(event, Error)]
    assert error.run == 1 and error.fatal
    assert error.message.startswith("cannot use the run's workspace: [Errno 2] No such file or directory")
    assert isinstance(events[-1], SessionEnd)


def test_a_workspace_removed_while_the_model_loads_is_one_line(tmp_path):
    """The script was checked, then its workspace went (the model loads for seconds): FileNotFoundError's
    traceback came out of the session's making."""
    (tmp_path / "ws").mkdir()
    script = load_script(write_script(tmp_path, 'workspace = "ws"\n'))
    (tmp_path / "ws").rmdir()
    with pytest.raises(SpecchatError, match=r"^workspace: cannot use .*ws: No such file or directory$"):
        AgentSession(ScriptedEngine([]), script)


def test_calls_after_the_wall_time_are_not_run(tmp_path):
    """max_wall_s bounds a run: the calls of one reply ran to the last after it had passed (six calls of a tool that
    takes longer than the limit ran the run to six times it), and a last step's then ended as max_steps. The call in
    flight finishes; the later ones are not started, and the run ends as max_wall_s."""
    (tmp_path / "slow.py").write_text(
        "import time\nfrom specchat.agent import tool\n\n\n@tool\ndef wait(seconds: float) -> str:\n"
        '    """Wait."""\n    time.sleep(seconds)\n    return "waited"\n'
    )
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["t"]\nmax_wall_s = 2\nmax_steps = 1\n[tools.user]\nmodule = "slow.py"\ntimeout_s = 30\n')
    calls = "<tool_call>[" + ", ".join(['{"name": "wait", "arguments": {"seconds": 2.5}}'] * 6) + "]</tool_call>"
    outcomes, events = run(ScriptedEngine([calls]), path)
    assert [e.content for e in events if isinstance(e, ToolResultEvent)] == ["waited"]
    assert (outcomes[0].reason, outcomes[0].steps) == ("max_wall_s", 1)


def test_ctrl_c_that_reaches_a_runs_thread_stops_the_session(tmp_path):
    """The kernel hands a process-directed signal (Ctrl-C, SIGTERM) to any thread; one that reached a run's thread
    only flagged it for the main thread, blocked on a run's result without a timeout, so Ctrl-C did nothing until a
    run ended (here, never: the reply hangs until it is cancelled)."""
    import signal

    session = AgentSession(ScriptedEngine([HANG]), load_script(write_script(tmp_path)))
    rescued = threading.Event()

    def interrupt_a_run() -> None:
        while not (runs := [t for t in threading.enumerate() if t.name.startswith("specchat-agent")]):
            time.sleep(0.01)
        signal.pthread_kill(runs[0].ident, signal.SIGINT)
        if not session.cancelled.wait(30):  # the interrupt was lost: end the run, so that the test fails, not hangs
            rescued.set()
            session.cancel()

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_a_run, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            session.run(lambda event: None)
    finally:
        signal.signal(signal.SIGINT, before)
    assert not rescued.is_set()


def test_a_reply_that_ends_just_past_the_wall_time_still_gives_its_final_answer(tmp_path, monkeypatch):
    """A reply that finished (not cut off) as max_wall_s ran out is acted on: its final_answer call counts, as a tag
    answer in the same reply would; only the calls after the first are not started once the time is up."""
    import time

    import tests.agent.scripted_engine as scripted

    class Slow(scripted.ScriptedHandle):
        def events(self):
            time.sleep(1.2)  # the reply ends after the wall time: the engine's cancel came too late to stop it
            yield from super().events()

    monkeypatch.setattr(scripted, "ScriptedHandle", Slow)
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["t"]\nmax_wall_s = 1\nmax_steps = 3\n[tools]\nenabled = ["final_answer"]\n')
    reply = '<tool_call>[{"name": "final_answer", "arguments": {"answer": "391"}}]</tool_call>'
    outcomes, _ = run(ScriptedEngine([reply]), path)
    assert (outcomes[0].reason, outcomes[0].answer) == ("final", "391")


def test_a_run_that_raises_stops_the_others_at_once(tmp_path, monkeypatch):
    """A run that raised (our bug) cancels the runs beside it as soon as it fails: the session waited for every run to
    end first, so a run waiting on a reply that never comes kept the session, and the bug's report, waiting for good."""
    path = tmp_path / "agent.toml"
    path.write_text('tasks = ["a", "b"]\nconcurrency = 2\n')
    session = AgentSession(ScriptedEngine([HANG]), load_script(path))
    run_one = AgentSession._run_one

    def failing(self, index, emit):
        if index == 1:
            time.sleep(0.2)  # run 0 is waiting on its reply by then
            raise RuntimeError("a bug of ours")
        return run_one(self, index, emit)

    monkeypatch.setattr(AgentSession, "_run_one", failing)
    raised: list[BaseException] = []

    def work() -> None:
        try:
            session.run(lambda event: None)
        except RuntimeError as error:
            raised.append(error)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and [str(e) for e in raised] == ["a bug of ours"]
