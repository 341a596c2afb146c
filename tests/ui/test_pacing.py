"""The streaming reply's pace (ui/pacing.py): 20 growths a second while the UI thread's frames are cheap, fewer while
they take more than their share of a core, back again when they are cheap."""

from __future__ import annotations

import pytest

from specchat.ui import pacing
from specchat.ui.pacing import FASTEST_S, SLOWEST_S, STEP, WINDOW_S, StreamPacer


class Clocks:
    """A wall clock and the UI thread's CPU time, moved by hand."""

    def __init__(self) -> None:
        self.wall = self.cpu = 100.0

    def spend(self, wall_s: float, share: float) -> None:
        self.wall += wall_s
        self.cpu += wall_s * share


def pacer_on(clocks: Clocks, share: float = 0.15) -> StreamPacer:
    return StreamPacer(share, clock=lambda: clocks.wall, cpu=lambda: clocks.cpu)


def stream(pacer: StreamPacer, clocks: Clocks, seconds: float, ui_share: float) -> None:
    """A reply growing every 50 ms for `seconds`, the UI thread busy `ui_share` of the time."""
    for _ in range(round(seconds / 0.05)):
        clocks.spend(0.05, ui_share)
        pacer.observe()


def test_cheap_frames_keep_the_fastest_pace():
    clocks = Clocks()
    pacer = pacer_on(clocks)
    stream(pacer, clocks, 5.0, ui_share=0.05)
    assert pacer.interval == FASTEST_S
    shown_at = clocks.wall
    clocks.spend(FASTEST_S / 2, 0.0)
    assert not pacer.due(shown_at)
    clocks.spend(FASTEST_S / 2, 0.0)
    assert pacer.due(shown_at)


def test_costly_frames_slow_the_reply_down_to_the_slowest_pace_and_no_further():
    clocks = Clocks()
    pacer = pacer_on(clocks)
    stream(pacer, clocks, 1.5 * WINDOW_S, ui_share=0.5)  # the first window closes
    assert pacer.interval == pytest.approx(FASTEST_S * STEP)
    stream(pacer, clocks, 20 * WINDOW_S, ui_share=0.5)
    assert pacer.interval == SLOWEST_S


def test_the_pace_comes_back_when_frames_are_cheap_again_and_holds_in_between():
    clocks = Clocks()
    pacer = pacer_on(clocks)
    stream(pacer, clocks, 20 * WINDOW_S, ui_share=0.5)
    stream(pacer, clocks, 3 * WINDOW_S, ui_share=0.1)  # between half the share and the share: as it is
    assert pacer.interval == SLOWEST_S
    stream(pacer, clocks, 20 * WINDOW_S, ui_share=0.02)
    assert pacer.interval == FASTEST_S


def test_time_between_replies_is_not_judged():
    clocks = Clocks()
    pacer = pacer_on(clocks)
    stream(pacer, clocks, 20 * WINDOW_S, ui_share=0.5)
    pacer.pause()  # the reply ended; the user reads and types for a minute, the UI thread nearly idle
    clocks.spend(60.0, 0.001)
    pacer.observe()  # the next reply's first growth starts a window
    assert pacer.interval == SLOWEST_S
    stream(pacer, clocks, 0.5 * WINDOW_S, ui_share=0.5)
    assert pacer.interval == SLOWEST_S


def test_the_share_defaults_to_the_module_setting(monkeypatch):
    monkeypatch.setattr(pacing, "UI_SHARE", 1.0)  # (benchmarks/tui_speed.py --ui-share 1: the old fixed 20 Hz)
    clocks = Clocks()
    pacer = StreamPacer(clock=lambda: clocks.wall, cpu=lambda: clocks.cpu)
    stream(pacer, clocks, 10 * WINDOW_S, ui_share=0.9)
    assert pacer.interval == FASTEST_S
