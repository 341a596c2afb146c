"""How often a streaming reply grows on screen: as often as the UI can afford beside the engine.

Each growth of the reply is a frame: Textual lays out the screen again and renders what moved, ~15-30 ms of the UI
thread's time on a 2-core Xeon for a long chat (docs/tui.md). The UI thread shares the machine with the engine's
threads, so on a CPU whose cores the engine fills, every millisecond of frames is taken from decoding: at 20 frames
a second the app decoded ~85 tok/s where the engine alone decodes ~230. A StreamPacer keeps the reply's frames
within a share of one core: over each WINDOW_S it reads the UI thread's own CPU time (`time.thread_time`, so the
engine's threads do not count) against the wall time, and lengthens the interval while the share is above `share`,
shortens it while under half of it, between FASTEST_S (where frames are cheap: a fast machine, a short chat) and
SLOWEST_S (text still flows four times a second).
"""

from __future__ import annotations

import time
from collections.abc import Callable

FASTEST_S = 0.05  # the reply grows at most 20 times a second
SLOWEST_S = 0.25  # ... and at least 4 times
UI_SHARE = 0.15  # of one core, for the UI thread while replies stream
WINDOW_S = 1.0  # the UI thread's time is read over this much wall time
STEP = 1.5  # the interval's factor per window out of bounds


class StreamPacer:
    """The interval between two growths of a streaming reply, adapted to what the UI thread spends (one per chat:
    every chat reads the same thread, so chats streaming at once slow down together)."""

    def __init__(
        self,
        share: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.share = UI_SHARE if share is None else share
        self.clock, self.cpu = clock, cpu
        self.interval = FASTEST_S
        self.window: tuple[float, float] | None = None  # (wall, UI thread CPU) at the window's start

    def due(self, since: float) -> bool:
        """Whether the reply last shown at `since` (the clock's time) may grow now."""
        return self.clock() - since >= self.interval

    def observe(self) -> None:
        """A reply grew: on the UI thread, once per growth while a reply streams (a window spans only streaming)."""
        now, cpu = self.clock(), self.cpu()
        if self.window is None:
            self.window = (now, cpu)
            return
        wall0, cpu0 = self.window
        if now - wall0 < WINDOW_S:
            return
        share = (cpu - cpu0) / (now - wall0)
        if share > self.share:
            self.interval = min(SLOWEST_S, self.interval * STEP)
        elif share < self.share / 2:
            self.interval = max(FASTEST_S, self.interval / STEP)
        self.window = (now, cpu)

    def pause(self) -> None:
        """The reply ended: the next window starts with the next reply (time between replies is not streaming)."""
        self.window = None
