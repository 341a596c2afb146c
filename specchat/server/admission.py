"""How many requests the server holds at once: the engine's batch, and a bounded queue of requests waiting for it.

Without a bound, requests past what the engine runs wait without limit: under overload every client waits longer and
longer (and each waiting request holds a connection, its body and its encoded prompt) until clients time out, and a
load balancer never hears that this server is full. With one, a request past `max_queue` waiting is refused at once
with a 503 and a Retry-After (docs/serve.md says why 503 and not TGI's 429), which the openai client retries after
the delay it names.

A request is in flight from its admission (after its body is read and checked) to the end of its answer; the waiting
are those in flight past the engine's `max_running`. The engine also holds back requests its KV cache cannot fit
yet, so more than `max_queue` may wait in its scheduler: the bound is on the requests in flight,
`max_running + max_queue`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specchat.errors import ConfigError
from specchat.server import DEFAULT_MAX_QUEUE
from specchat.server.protocol import ApiError

RETRY_AFTER_S = 1  # what a refused request's Retry-After asks: about an answer's time on a busy server


@dataclass(slots=True)
class Admission:
    """The requests in flight, and the bound on those waiting (`max_queue`, 0: none). Used on the server's event loop
    only: `admit` counts a request before its handler next awaits, so a burst is bounded as it arrives."""

    max_running: int  # the engine's batch (EngineConfig.max_running): requests in flight past it wait
    max_queue: int = DEFAULT_MAX_QUEUE
    in_flight: int = field(default=0, init=False)
    rejected: int = field(default=0, init=False)  # requests refused because the queue was full, since start

    def __post_init__(self) -> None:
        if self.max_running <= 0:
            raise ConfigError(f"max-running must be > 0, got {self.max_running}")
        if self.max_queue < 0:
            raise ConfigError(f"max-queue must be >= 0 (0: no bound), got {self.max_queue}")

    @property
    def waiting(self) -> int:
        """Requests in flight that the engine's batch has no room for."""
        return max(self.in_flight - self.max_running, 0)

    def admit(self) -> None:
        """Count a request in, or refuse it with a 503 where `max_queue` requests already wait."""
        if self.max_queue and self.waiting >= self.max_queue:
            self.rejected += 1
            raise ApiError(
                503,
                f"the server is overloaded: {self.waiting} requests already wait for the {self.max_running} running;"
                f" retry in {RETRY_AFTER_S} s",
                code="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.in_flight += 1

    def release(self) -> None:
        """A request admitted earlier has ended (answered, refused later, or its client gone)."""
        self.in_flight -= 1
