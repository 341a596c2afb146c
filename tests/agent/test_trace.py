"""Trace events: JSONL with a type on every line, and a compact readable printer."""

import io
import json

from specchat.agent.trace import (
    Error,
    Final,
    JsonlWriter,
    RunEnd,
    RunStart,
    Step,
    ToolCallEvent,
    ToolResultEvent,
    TracePrinter,
)

STATS = {"steps": 20, "drafted": 40, "accepted": 22, "acceptance_rate": 0.55, "tokens_per_step": 2.1}


def run_events() -> list:
    return [
        RunStart(
            run=0,
            task="What is 17 * 23?",
            model="smollm2-135m",
            drafter="ngram",
            k=None,
            tools=["python", "final_answer"],
            max_steps=4,
        ),
        Step(
            run=0,
            step=1,
            text='<tool_call>{"name": "python"}</tool_call>',
            tokens=42,
            finish_reason="eos",
            elapsed_s=0.5,
            stats=STATS,
        ),
        ToolCallEvent(run=0, step=1, id="c00010000", name="python", arguments={"code": "print(17 * 23)"}),
        ToolResultEvent(run=0, step=1, id="c00010000", name="python", ok=True, content="391\n"),
        Error(run=0, step=2, message="tool call could not be parsed: the JSON is cut off"),
        Final(run=0, step=3, answer="391", source="final_answer"),
        RunEnd(
            run=0,
            reason="final",
            steps=3,
            tokens=100,
            elapsed_s=1.5,
            answer="391",
            stats={**STATS, "prefix_hit_rate": 0.8},
        ),
    ]


def test_jsonl_has_one_typed_object_per_line():
    stream = io.StringIO()
    writer = JsonlWriter(stream)
    for event in run_events():
        writer.write(event)
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["type"] for r in records] == [
        "run_start",
        "step",
        "tool_call",
        "tool_result",
        "error",
        "final",
        "run_end",
    ]
    assert all(next(iter(r)) == "type" and r["run"] == 0 for r in records)
    assert records[0]["k"] is None
    assert records[1]["stats"]["tokens_per_step"] == 2.1
    assert records[2]["arguments"] == {"code": "print(17 * 23)"}
    assert records[3]["ok"] is True and records[3]["error"] is None
    assert records[4]["fatal"] is False
    assert records[6]["answer"] == "391"


def test_printer_shows_each_event_compactly():
    stream = io.StringIO()
    printer = TracePrinter(stream)
    for event in run_events():
        printer.write(event)
    text = stream.getvalue()
    assert "[run 0] task: What is 17 * 23?" in text
    assert "drafter ngram k=auto" in text
    assert "[run 0] step 1: 42 tokens, 2.10 tokens/step, 55% accepted" in text
    assert '[run 0]   -> python({"code": "print(17 * 23)"})' in text
    assert "[run 0]   <- python ok\n      | 391" in text
    assert "[run 0] !! tool call could not be parsed" in text
    assert "[run 0] => final answer (final_answer): 391" in text
    assert "[run 0] end: final after 3 steps, 100 tokens, 1.5 s" in text and "80% prefix-cache hits" in text


def test_printer_cuts_long_text_and_lines():
    printer = TracePrinter(io.StringIO(), width=40, max_lines=3)
    lines = printer.format(
        ToolResultEvent(
            run=2,
            step=1,
            id="x",
            name="read_file",
            ok=False,
            content="\n".join("y" * 100 for _ in range(10)),
            error="boom",
        )
    )
    assert lines[0] == "[run 2]   <- read_file error: boom"
    assert len(lines) == 5 and lines[-1].endswith("7 more lines")
    assert all(len(line) <= 40 for line in lines)


def test_printer_escapes_control_characters():
    """A tool's output holding "\x1b[2J" or an OSC title string cleared or retitled the user's terminal."""
    stream = io.StringIO()
    printer = TracePrinter(stream)
    content = "before\x1b[2Jafter\n\x1b]0;pwned\x07\ttab"
    printer.write(ToolResultEvent(run=0, step=1, id="x", name="shell", ok=True, content=content))
    text = stream.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert "before\\x1b[2Jafter" in text and "\\x1b]0;pwned\\x07\ttab" in text


def test_a_stdout_that_is_not_utf8_gets_escapes_not_a_traceback():
    """With PYTHONIOENCODING=ascii (or a latin-1 locale) a task or reply in another script raised UnicodeEncodeError
    in the run's thread, and the session ended in a traceback."""
    event = Final(run=0, step=1, answer="日本 ü \U0001f600", source="tag")
    for encoding in ("ascii", "latin-1"):
        raw = io.BytesIO()
        stream = io.TextIOWrapper(raw, encoding=encoding)
        JsonlWriter(stream).write(event)
        TracePrinter(stream).write(event)
        record, text = raw.getvalue().decode(encoding).split("\n", 1)
        assert json.loads(record)["answer"] == "日本 ü \U0001f600"  # JSON's own escapes: the same string
        assert text.startswith("[run 0] => final answer (tag): ") and "\\u65e5\\u672c" in text
    utf8 = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    JsonlWriter(utf8).write(event)
    utf8.flush()
    assert "日本" in utf8.buffer.getvalue().decode("utf-8")


def test_counts_of_one_read_in_the_singular():
    """'step 1: 1 tokens' and 'max 1 steps' read as counts of one."""
    events = run_events()
    start = RunStart(run=0, task="t", model="m", drafter="ngram", k=None, tools=["python"], max_steps=1)
    step = Step(run=0, step=1, text="x", tokens=1, finish_reason="eos", elapsed_s=0.1, stats=events[1].stats)
    printer = TracePrinter(io.StringIO())
    text = "\n".join(printer.format(start) + printer.format(step))
    assert "max 1 step" in text and "max 1 steps" not in text
    assert "step 1: 1 token" in text and "1 tokens" not in text
