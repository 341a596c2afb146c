"""Live numbers for the side panels, computed from the engine's events (one batch per step).

The UI sees every step's events, so it derives its "now" figures from them with the definitions of
`engine.stats` (acceptance = accepted / drafted, tokens per step = emitted / steps, ...), over a rolling
window of recent steps of all requests together:
- tok/s: completion tokens of the steps in the last `rate_window_s` seconds, divided by the time between the
  first and the last of those steps (so idle gaps between answers do not count).
- inter-token latency: for each request, the gap between two steps that emitted tokens divided by the tokens
  of the later step (a step that emits n tokens contributes n equal latencies); time to first token excluded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from specchat.engine.sequence import Event, Finished, StepEvent, TextDelta
from specchat.engine.stats import SpecStats, StepRecord, percentile

HISTORY = 60  # points kept for the sparklines


@dataclass(frozen=True, slots=True)
class MetricsView:
    """What the Speculation and Throughput panels show at one moment (None = no data yet)."""

    steps: int = 0
    acceptance_now: float | None = None
    acceptance_history: tuple[float, ...] = ()
    tokens_per_step_now: float | None = None
    emitted_histogram: tuple[int, ...] = ()  # [n] = steps that emitted n tokens, over the window
    position_acceptance: tuple[float, ...] = ()  # [i] = how often the (i+1)-th draft was accepted
    draft_ms: float | None = None  # mean per step, over the window
    verify_ms: float | None = None
    k_last: int | None = None  # drafts proposed at the newest step
    k_next: int | None = None  # drafts the newest request will propose next
    tok_per_s: float | None = None
    tok_per_s_history: tuple[float, ...] = ()
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    active_requests: int = 0
    queue_depth: int | None = None  # requests waiting for a slot (engine.snapshot() only)
    total_tokens: int = 0


class LiveMetrics:
    """Folds step events into rolling windows; `view()` turns them into a MetricsView."""

    def __init__(self, window: int = 128, rate_window_s: float = 2.0, latency_window: int = 1024) -> None:
        self.window = window
        self.rate_window_s = rate_window_s
        self.records: deque[StepRecord] = deque(maxlen=window)
        self.token_times: deque[tuple[float, int]] = deque()  # (step time, tokens emitted)
        self.latencies_ms: deque[float] = deque(maxlen=latency_window)
        self.last_emit: dict[int, float] = {}  # request id -> time of its newest token-emitting step
        self.acceptance_history: deque[float] = deque(maxlen=HISTORY)
        self.rate_history: deque[float] = deque(maxlen=HISTORY)
        self.steps = 0
        self.total_tokens = 0
        self.k_last: int | None = None
        self.k_next: int | None = None
        self.dirty = False

    def observe(self, events: Iterable[Event], t: float) -> None:
        """Fold in the events of one engine step, which ended at perf_counter time `t`."""
        tokens = 0
        for event in events:
            if isinstance(event, StepEvent):
                self.records.append(event.record)
                self.steps += 1
                self.k_last, self.k_next = event.record.k, event.k_next
            elif isinstance(event, TextDelta) and event.token_ids:
                n = len(event.token_ids)
                tokens += n
                before = self.last_emit.get(event.request_id)
                if before is not None:
                    self.latencies_ms.extend([(t - before) * 1e3 / n] * n)
                self.last_emit[event.request_id] = t
            elif isinstance(event, Finished):
                self.last_emit.pop(event.request_id, None)
        if tokens:
            self.token_times.append((t, tokens))
            self.total_tokens += tokens
        while self.token_times and self.token_times[0][0] < t - self.rate_window_s:
            self.token_times.popleft()
        self.dirty = True

    def tok_per_s(self) -> float | None:
        """Tokens per second over the recent steps (the first step's tokens open the interval)."""
        if len(self.token_times) < 2:
            return None
        span = self.token_times[-1][0] - self.token_times[0][0]
        tokens = sum(n for _, n in list(self.token_times)[1:])
        return tokens / span if span > 0 else None

    def sample(self) -> None:
        """Add the current values to the sparkline histories (called on the UI's refresh tick)."""
        stats = self.window_stats()
        if stats.drafted:
            self.acceptance_history.append(stats.acceptance_rate)
        rate = self.tok_per_s()
        if rate is not None:
            self.rate_history.append(rate)
        self.dirty = False

    def window_stats(self) -> SpecStats:
        stats = SpecStats(window=self.window)
        for rec in self.records:
            stats.observe_step(rec)
        return stats

    def view(self) -> MetricsView:
        """A frozen copy of the current figures for the panels."""
        stats = self.window_stats()
        positions = tuple(
            a / d if d else 0.0 for a, d in zip(stats.accepted_per_position, stats.drafted_per_position, strict=True)
        )
        lat = list(self.latencies_ms)
        return MetricsView(
            steps=self.steps,
            acceptance_now=stats.acceptance_rate if stats.drafted else None,
            acceptance_history=tuple(self.acceptance_history),
            tokens_per_step_now=stats.tokens_per_step if stats.steps else None,
            emitted_histogram=tuple(stats.emitted_histogram),
            position_acceptance=positions,
            draft_ms=stats.draft_ms / stats.steps if stats.steps else None,
            verify_ms=stats.verify_ms / stats.steps if stats.steps else None,
            k_last=self.k_last,
            k_next=self.k_next,
            tok_per_s=self.tok_per_s(),
            tok_per_s_history=tuple(self.rate_history),
            itl_p50_ms=percentile(lat, 50) if lat else None,
            itl_p99_ms=percentile(lat, 99) if lat else None,
            active_requests=len(self.last_emit),
            total_tokens=self.total_tokens,
        )
