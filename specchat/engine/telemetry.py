"""Engine-wide metrics, fed one step's events at a time: the one source of every figure the UI, `specchat bench`,
`--json` and logs show.

Definitions:
- speculation: engine.stats.SpecStats over every step of every request since start (or reset); `recent` is the
  same over the last `spec_window` steps of all requests together (what the panels show as "now"), since the
  last drafter switch of every live request.
- tok/s: completion tokens emitted in the `rate_window_s` seconds up to the newest emission, over the time from
  the first to the last emission in that window (the first one's tokens open the interval). Idle time after an
  answer does not count: between answers it reads the rate at which the last one ended.
- inter-token latency (ITL): for a step that gives a request n tokens, the time since that request's previous
  tokens divided by n (n equal samples). A request's first tokens are not an inter-token gap: they count in the
  time to first token (TTFT), from submission.
- k_last / k_next: drafts proposed at the newest step, and what that request will propose next.
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

    spec: SpecStats  # totals since start
    recent: SpecStats  # the last steps only
    tok_per_s: float | None  # None until two emissions
    itl_p50_ms: float | None  # None until an inter-token gap was seen
    itl_p99_ms: float | None
    ttft_p50_ms: float | None
    running: int
    waiting: int
    tokens_total: int
    finished_total: int
    k_last: int | None
    k_next: int | None
    memory: dict


@dataclass(slots=True)
class EngineMetrics:
    rate_window_s: float = 2.0
    # ITL and TTFT samples kept for the percentiles: the newest 2,048 (what the panels show), None for all of them
    # (a benchmark's run: the newest alone are its tail, where the batch drains)
    latency_window: int | None = 2048
    spec_window: int = 128
    spec: SpecStats = field(default_factory=SpecStats)
    tokens_total: int = 0
    finished_total: int = 0
    k_last: int | None = None
    k_next: int | None = None
    emissions: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per step with tokens
    itl_ms: deque[float] = field(default_factory=deque)
    ttft_ms: deque[float] = field(default_factory=deque)
    submitted: dict[int, float] = field(default_factory=dict)  # request id -> submission time, until first tokens
    last_emit: dict[int, float] = field(default_factory=dict)  # request id -> time of its previous tokens

    def __post_init__(self) -> None:
        self.spec.window = self.spec_window

    def observe_drafter_switch(self) -> None:
        """Every live request changed drafter: `recent` starts afresh, so "now" never mixes two drafters' steps."""
        self.spec.recent.clear()

    def observe_submit(self, request_id: int, now: float | None = None) -> None:
        self.submitted[request_id] = time.perf_counter() if now is None else now

    def observe_events(self, events: list[Event], now: float | None = None) -> None:
        """Fold in the events of one engine step, which ended at perf_counter time `now`."""
        now = time.perf_counter() if now is None else now
        tokens = 0
        for ev in events:
            if isinstance(ev, StepEvent):
                self.spec.observe_step(ev.record)
                self.k_last, self.k_next = ev.record.k, ev.k_next
            elif isinstance(ev, TextDelta) and ev.token_ids:
                n = len(ev.token_ids)
                tokens += n
                prev = self.last_emit.get(ev.request_id)
                if prev is not None:
                    _push(self.itl_ms, [(now - prev) * 1e3 / n] * n, self.latency_window)
                elif ev.request_id in self.submitted:
                    _push(self.ttft_ms, [(now - self.submitted.pop(ev.request_id)) * 1e3], self.latency_window)
                self.last_emit[ev.request_id] = now
            elif isinstance(ev, Finished):
                self.finished_total += 1
                self.last_emit.pop(ev.request_id, None)
                self.submitted.pop(ev.request_id, None)
        if tokens:
            self.tokens_total += tokens
            self.emissions.append((now, tokens))
            while self.emissions[0][0] < now - self.rate_window_s:
                self.emissions.popleft()

    def tok_per_s(self) -> float | None:
        if len(self.emissions) < 2:
            return None
        span = self.emissions[-1][0] - self.emissions[0][0]
        return sum(n for _, n in list(self.emissions)[1:]) / span if span > 0 else None

    def snapshot(self, running: int, waiting: int, memory: dict) -> Snapshot:
        itl, ttft = list(self.itl_ms), list(self.ttft_ms)
        return Snapshot(
            spec=_copy(self.spec),
            recent=self.spec.recent_stats(),
            tok_per_s=self.tok_per_s(),
            itl_p50_ms=percentile(itl, 50) if itl else None,
            itl_p99_ms=percentile(itl, 99) if itl else None,
            ttft_p50_ms=percentile(ttft, 50) if ttft else None,
            running=running,
            waiting=waiting,
            tokens_total=self.tokens_total,
            finished_total=self.finished_total,
            k_last=self.k_last,
            k_next=self.k_next,
            memory=memory,
        )


def _push(values: deque[float], new: list[float], limit: int | None) -> None:
    values.extend(new)
    while limit is not None and len(values) > limit:
        values.popleft()


def _copy(stats: SpecStats) -> SpecStats:
    """A copy that later steps do not change (the totals and the recent records)."""
    copy = SpecStats(window=stats.window)
    copy.merge(stats)
    copy.recent.extend(stats.recent)
    return copy
