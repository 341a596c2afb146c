"""What the Speculation and Throughput panels show: the engine's own figures (engine.telemetry), read between
steps as a Snapshot, plus the sparklines' histories sampled from those snapshots.

The UI computes no figure of its own: acceptance, tokens per step, tok/s and latency mean what
engine.telemetry and engine.stats define, the same numbers `specchat bench`, `--json` and the logs print.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specchat.engine.telemetry import Snapshot

HISTORY = 60  # points kept for the sparklines


@dataclass(frozen=True, slots=True)
class MetricsView:
    """What the Speculation and Throughput panels show at one moment (None = no data yet)."""

    steps: int = 0
    acceptance_now: float | None = None
    acceptance_history: tuple[float, ...] = ()
    tokens_per_step_now: float | None = None
    emitted_histogram: tuple[int, ...] = ()  # [n] = steps that emitted n tokens, over the recent steps
    position_acceptance: tuple[float, ...] = ()  # [i] = how often the (i+1)-th draft was accepted
    draft_ms: float | None = None  # mean per step, over the recent steps
    verify_ms: float | None = None
    k_last: int | None = None  # drafts proposed at the newest step
    k_next: int | None = None  # drafts the newest request will propose next
    tok_per_s: float | None = None
    tok_per_s_history: tuple[float, ...] = ()
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    active_requests: int = 0
    queue_depth: int | None = None  # requests waiting for a slot
    total_tokens: int = 0


class PanelFigures:
    """The newest engine Snapshot, and the histories of acceptance and tok/s that the sparklines draw."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self.acceptance_history: deque[float] = deque(maxlen=HISTORY)
        self.rate_history: deque[float] = deque(maxlen=HISTORY)
        self.dirty = False

    def observe(self, snap: Snapshot) -> None:
        """Take a new reading; the histories grow only when tokens were emitted since the last one."""
        moved = self.snapshot is None or snap.tokens_total != self.snapshot.tokens_total
        self.snapshot = snap
        if moved and snap.tokens_total:
            if snap.recent.drafted:
                self.acceptance_history.append(snap.recent.acceptance_rate)
            if snap.tok_per_s is not None:
                self.rate_history.append(snap.tok_per_s)
        self.dirty = True

    @property
    def steps(self) -> int:
        return self.snapshot.spec.steps if self.snapshot else 0

    @property
    def total_tokens(self) -> int:
        return self.snapshot.tokens_total if self.snapshot else 0

    @property
    def k_next(self) -> int | None:
        return self.snapshot.k_next if self.snapshot else None

    def view(self) -> MetricsView:
        """A frozen copy of the current figures for the panels."""
        snap = self.snapshot
        if snap is None:
            return MetricsView()
        recent = snap.recent
        return MetricsView(
            steps=snap.spec.steps,
            acceptance_now=recent.acceptance_rate if recent.drafted else None,
            acceptance_history=tuple(self.acceptance_history),
            tokens_per_step_now=recent.tokens_per_step if recent.steps else None,
            emitted_histogram=tuple(recent.emitted_histogram),
            position_acceptance=tuple(recent.acceptance_per_position),
            draft_ms=recent.draft_ms_per_step if recent.steps else None,
            verify_ms=recent.verify_ms_per_step if recent.steps else None,
            k_last=snap.k_last,
            k_next=snap.k_next,
            tok_per_s=snap.tok_per_s,
            tok_per_s_history=tuple(self.rate_history),
            itl_p50_ms=snap.itl_p50_ms,
            itl_p99_ms=snap.itl_p99_ms,
            active_requests=snap.running,
            queue_depth=snap.waiting,
            total_tokens=snap.tokens_total,
        )
