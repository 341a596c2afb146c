"""Engine-wide metrics: aggregate speculation, throughput and per-token latency, fed one step at a time.

Definitions:
- per-token latency: for a step that gives a request n tokens, the time since that request's previous tokens
  divided by n (the first tokens of a request count from its submission: time to first token / n).
- tok/s now: tokens emitted across all requests during the last `rate_window_s` seconds.
- speculation totals: engine.stats.SpecStats over every step of every request since start (or reset).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specchat.engine.sequence import Event, Finished, StepEvent, TextDelta
from specchat.engine.stats import SpecStats, percentile


@dataclass(slots=True)
class Snapshot:
    """What the engine is doing now; read by the UI panels, `specchat bench` and logs."""

    spec: SpecStats
    tok_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    running: int
    waiting: int
    tokens_total: int
    finished_total: int
    memory: dict


@dataclass(slots=True)
class EngineMetrics:
    rate_window_s: float = 5.0
    latency_window: int = 2048
    spec: SpecStats = field(default_factory=lambda: SpecStats(window=64))
    tokens_total: int = 0
    finished_total: int = 0
    emissions: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per delta
    latencies_ms: deque[float] = field(default_factory=deque)
    last_emit: dict[int, float] = field(default_factory=dict)  # request id -> time of its previous tokens

    def observe_submit(self, request_id: int, now: float | None = None) -> None:
        self.last_emit[request_id] = time.perf_counter() if now is None else now

    def observe_events(self, events: list[Event], now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        for ev in events:
            if isinstance(ev, StepEvent):
                self.spec.observe_step(ev.record)
            elif isinstance(ev, TextDelta) and ev.token_ids:
                n = len(ev.token_ids)
                self.tokens_total += n
                self.emissions.append((now, n))
                prev = self.last_emit.get(ev.request_id)
                if prev is not None:
                    self.latencies_ms.extend([(now - prev) * 1e3 / n] * n)
                    while len(self.latencies_ms) > self.latency_window:
                        self.latencies_ms.popleft()
                self.last_emit[ev.request_id] = now
            elif isinstance(ev, Finished):
                self.finished_total += 1
                self.last_emit.pop(ev.request_id, None)
        while self.emissions and self.emissions[0][0] < now - self.rate_window_s:
            self.emissions.popleft()

    def tok_per_s(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        recent = [(t, n) for t, n in self.emissions if t >= now - self.rate_window_s]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0][0], 1e-9)
        return sum(n for _, n in recent[1:]) / span

    def latency_percentiles(self) -> tuple[float, float]:
        values = list(self.latencies_ms)
        return percentile(values, 50), percentile(values, 99)
