"""SpecStats: the written definitions, merging, and the JSON field names (an interface)."""

from __future__ import annotations

import pytest

from specchat.engine.stats import SpecStats, StepRecord


def test_definitions_over_a_few_steps():
    stats = SpecStats()
    stats.observe_step(StepRecord(k=4, accepted=4, emitted=5, draft_ms=1.0, verify_ms=10.0))
    stats.observe_step(StepRecord(k=4, accepted=1, emitted=2, draft_ms=1.0, verify_ms=10.0))
    stats.observe_step(StepRecord(k=0, accepted=0, emitted=1, verify_ms=7.0))
    assert (stats.steps, stats.drafts, stats.drafted, stats.accepted, stats.emitted) == (3, 2, 8, 5, 8)
    assert stats.acceptance_rate == pytest.approx(5 / 8)
    assert stats.tokens_per_step == pytest.approx(8 / 3)
    assert stats.accepted_per_position == [2, 1, 1, 1]
    assert stats.drafted_per_position == [2, 2, 2, 2]
    assert stats.emitted_histogram == [0, 1, 1, 0, 0, 1]
    assert stats.verify_ms_per_step == pytest.approx(9.0)


def test_drafting_steps_match_vllm_mean_acceptance_length():
    stats = SpecStats()
    for accepted in (3, 0, 2):
        stats.observe_step(StepRecord(k=3, accepted=accepted, emitted=accepted + 1))
    assert stats.tokens_per_step == pytest.approx(1 + stats.accepted / stats.drafts)


def test_rolling_window_and_merge():
    stats = SpecStats(window=2)
    for accepted in (0, 2, 2):
        stats.observe_step(StepRecord(k=2, accepted=accepted, emitted=accepted + 1))
    assert stats.recent_acceptance_rate == 1.0 and stats.acceptance_rate == pytest.approx(4 / 6)
    total = SpecStats()
    total.merge(stats)
    total.merge(stats)
    assert (total.drafted, total.accepted, total.emitted_histogram) == (12, 8, [0, 2, 0, 4])


def test_json_fields():
    stats = SpecStats()
    stats.observe_step(StepRecord(k=1, accepted=1, emitted=2))
    doc = stats.to_json()
    for key in (
        "acceptance_rate",
        "tokens_per_step",
        "drafted",
        "accepted",
        "accepted_per_position",
        "emitted_histogram",
        "draft_ms",
        "verify_ms",
    ):
        assert key in doc
