"""EngineMetrics: the recent window after a drafter switch; the latency samples kept."""

from __future__ import annotations

import pytest

from specchat.engine.sequence import StepEvent, TextDelta
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


def _gaps(metrics: EngineMetrics, times_ms: list[float]) -> None:
    """One request emitting a token at each of these times."""
    for t in times_ms:
        metrics.observe_events([TextDelta(1, "x", [7])], now=t / 1e3)


def test_latency_percentiles_cover_the_newest_window_or_every_gap():
    # 100 gaps of 1 ms, then 10 of 5 ms: the window of the newest 10 sees only the slow tail
    times = [float(i) for i in range(101)] + [100.0 + 5 * i for i in range(1, 11)]
    windowed, whole = EngineMetrics(latency_window=10), EngineMetrics(latency_window=None)
    _gaps(windowed, times)
    _gaps(whole, times)
    assert windowed.snapshot(1, 0, {}).itl_p50_ms == pytest.approx(5.0)
    snap = whole.snapshot(1, 0, {})
    assert (snap.itl_p50_ms, snap.itl_p99_ms) == (pytest.approx(1.0), pytest.approx(5.0))
    assert len(whole.itl_ms) == 110
