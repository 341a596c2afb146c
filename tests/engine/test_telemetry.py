"""EngineMetrics: the recent window after a drafter switch."""

from __future__ import annotations

from specchat.engine.sequence import StepEvent
from specchat.engine.stats import StepRecord
from specchat.engine.telemetry import EngineMetrics


def test_recent_window_starts_afresh_at_a_drafter_switch():
    metrics = EngineMetrics()
    for _ in range(5):
        metrics.observe_events([StepEvent(1, StepRecord(k=4, accepted=4, emitted=5), 4)])
    metrics.observe_drafter_switch()
    metrics.observe_events([StepEvent(1, StepRecord(k=4, accepted=0, emitted=1), 4)])
    snap = metrics.snapshot(1, 0, {})
    assert (snap.recent.steps, snap.recent.acceptance_rate, snap.recent.tokens_per_step) == (1, 0.0, 1.0)
    assert (snap.spec.steps, snap.spec.accepted) == (6, 20)  # the totals keep every step
