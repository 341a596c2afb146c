"""StderrProgress where stderr is not a terminal: silent for quick stages, plain lines for long ones."""

from __future__ import annotations

from specchat.cli import options
from specchat.cli.options import StderrProgress


def test_a_long_stage_gets_plain_lines_and_a_quick_one_none(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(options.time, "monotonic", lambda: clock[0])
    bar = StderrProgress()
    assert not bar.enabled  # pytest's stderr is not a terminal
    for done in range(4):  # a quick stage: done within LOG_AFTER_S
        bar("loading", done, 3)
        clock[0] += 1
    bar("GPTQ", 0, 100)
    clock[0] += 6
    bar("GPTQ", 10, 100)  # past LOG_AFTER_S: a line with the share done and the time left
    clock[0] += 30
    bar("GPTQ", 20, 100)  # within LOG_EVERY_S of the last line: nothing
    clock[0] += 31
    bar("GPTQ", 40, 100)
    clock[0] += 100
    bar("GPTQ", 100, 100)  # done: nothing more
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["GPTQ: 10% after 6 s, about 1 min left", "GPTQ: 40% after 67 s, about 2 min left"]


def test_a_stage_near_its_end_says_under_a_minute_not_about_0_min(monkeypatch, capsys):
    """`perplexity: 15% after 5 s, about 0 min left` where 28 s were left."""
    clock = [100.0]
    monkeypatch.setattr(options.time, "monotonic", lambda: clock[0])
    bar = StderrProgress()
    bar("perplexity", 0, 100)
    clock[0] += 6
    bar("perplexity", 60, 100)
    assert capsys.readouterr().err.splitlines() == ["perplexity: 60% after 6 s, under a minute left"]
