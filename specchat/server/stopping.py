"""uvicorn's server, stopping so that answers in flight come back rather than being cut off."""

from __future__ import annotations

import threading
from types import FrameType

import uvicorn

from specchat.engine.api import ServedEngine

STOPPING_ERROR = "the server is stopping"


class StoppingServer(uvicorn.Server):
    """On SIGTERM / Ctrl-C uvicorn gives the requests in flight `timeout_graceful_shutdown` seconds, then cancels
    their tasks: a non-streaming client got a plain-text 500 and lost what its answer had written, a stream was cut
    without its end, and stderr got a CancelledError traceback. This server ends the engine's answers in flight
    `end_early_s` before that deadline (`Engine.end_all`), so each comes back as what it wrote so far: a completion
    with finish_reason "length" and the error, or its stream's last chunk and [DONE] (a request that wrote
    nothing: a 503 naming the error)."""

    def __init__(self, config: uvicorn.Config, engine: ServedEngine, end_early_s: float = 2.0) -> None:
        super().__init__(config)
        self.engine = engine
        self.end_early_s = end_early_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:  # the first signal (a second one forces the exit, as uvicorn's does)
            grace = self.config.timeout_graceful_shutdown or 0
            timer = threading.Timer(max(grace - self.end_early_s, 0.0), self.engine.end_all, args=(STOPPING_ERROR,))
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
