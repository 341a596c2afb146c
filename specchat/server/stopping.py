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

    def __init__(
        self, config: uvicorn.Config, engine: ServedEngine, end_early_s: float = 2.0, force_after_s: float = 2.0
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self.end_early_s = end_early_s
        self.force_after_s = force_after_s
        self.ending_now = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first signal stops gracefully (above). A second Ctrl-C forced uvicorn's exit at once: the handlers in
        flight were cancelled, a CancelledError traceback per request went to stderr and each client got a plain
        "Internal Server Error" or a cut stream. A second signal ends the answers now instead, so the server exits
        as soon as they are sent (uvicorn's forced exit follows `force_after_s` later, or at a third Ctrl-C)."""
        if not self.should_exit:  # the first signal
            grace = self.config.timeout_graceful_shutdown or 0
            self._later(max(grace - self.end_early_s, 0.0), self.end_answers)
        elif not self.ending_now:  # the second: not uvicorn's forced exit yet
            self.ending_now = True
            self._later(0.0, self.end_answers)  # (off the signal handler: end_all takes locks)
            self._later(self.force_after_s, setattr, self, "force_exit", True)
            return
        super().handle_exit(sig, frame)

    def end_answers(self) -> None:
        """End the engine's answers in flight, and the reads of request bodies still arriving (app.BodyReaders)."""
        self.engine.end_all(STOPPING_ERROR)
        readers = getattr(getattr(self.config.app, "state", None), "body_readers", None)
        if readers is not None:
            readers.stop()

    @staticmethod
    def _later(delay_s: float, function, *args) -> None:
        timer = threading.Timer(delay_s, function, args=args)
        timer.daemon = True
        timer.start()
