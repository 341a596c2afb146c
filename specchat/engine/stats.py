"""Speculation and throughput metrics: one object, read alike by the CLI JSON, the UI and the logs.

Definitions (compatible with vLLM's spec-decode metrics):
- step: one target forward for a request (plain decode or verification of k drafts); prefill is not a step.
- drafts: steps in which at least one token was drafted.
- drafted: draft tokens proposed, summed over steps.
- accepted: draft tokens the target kept (see engine.verify for accepted / recovered / bonus).
- acceptance rate = accepted / drafted.
- tokens per step = emitted / steps: tokens a request gains per target forward (1 without drafting). For
  steps that all draft this equals vLLM's mean acceptance length 1 + accepted / drafts.
- accepted_per_position[i] / drafted_per_position[i]: how often the (i+1)-th draft of a step was accepted.
- emitted_histogram[n]: steps that emitted n tokens (n = 1 .. k + 1).
- draft_ms / verify_ms: wall time spent proposing and in the target forward + verification, summed over steps;
  draft_ms_per_step / verify_ms_per_step: the same per step.
- recent_*: the same rates over the last `window` steps only (what the UI shows as "now").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepRecord:
    """What one step of one request did."""

    k: int  # drafts proposed
    accepted: int
    emitted: int  # accepted + 1, fewer if the request stopped inside the step
    draft_ms: float = 0.0
    verify_ms: float = 0.0


@dataclass(slots=True)
class SpecStats:
    """Running totals over steps, with a rolling window for "now" values."""

    window: int = 32
    steps: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    emitted_histogram: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    recent: deque[StepRecord] = field(default_factory=deque)

    def observe_step(self, rec: StepRecord) -> None:
        """(Run twice per request a step, the request's and the engine's: kept to plain local arithmetic.)"""
        k, accepted, emitted = rec.k, rec.accepted, rec.emitted
        self.steps += 1
        self.emitted += emitted
        self.draft_ms += rec.draft_ms
        self.verify_ms += rec.verify_ms
        if k > 0:
            self.drafts += 1
            self.drafted += k
            self.accepted += accepted
            drafted_at, accepted_at = self.drafted_per_position, self.accepted_per_position
            _grow(drafted_at, k)
            _grow(accepted_at, k)
            for i in range(k):
                drafted_at[i] += 1
            for i in range(min(accepted, k)):
                accepted_at[i] += 1
        histogram = self.emitted_histogram
        _grow(histogram, emitted + 1)
        histogram[emitted] += 1
        recent = self.recent
        recent.append(rec)
        while len(recent) > self.window:
            recent.popleft()

    def merge(self, other: SpecStats) -> None:
        """Add another request's totals (for engine-wide aggregates)."""
        for name in ("steps", "drafts", "drafted", "accepted", "emitted", "draft_ms", "verify_ms"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
            (self.emitted_histogram, other.emitted_histogram),
        ):
            _grow(mine, len(theirs))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def draft_ms_per_step(self) -> float:
        return self.draft_ms / self.steps if self.steps else 0.0

    @property
    def verify_ms_per_step(self) -> float:
        return self.verify_ms / self.steps if self.steps else 0.0

    @property
    def recent_acceptance_rate(self) -> float:
        drafted = sum(r.k for r in self.recent)
        return sum(r.accepted for r in self.recent) / drafted if drafted else 0.0

    @property
    def recent_tokens_per_step(self) -> float:
        return sum(r.emitted for r in self.recent) / len(self.recent) if self.recent else 0.0

    def recent_stats(self) -> SpecStats:
        """The same statistics over the last `window` steps only (per-position acceptance, histogram, ms, ...)."""
        recent = SpecStats(window=self.window)
        for rec in self.recent:
            recent.observe_step(rec)
        return recent

    @property
    def acceptance_per_position(self) -> list[float]:
        """[i] = accepted / drafted at draft position i + 1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    def to_json(self) -> dict:
        return {
            "steps": self.steps,
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "emitted_histogram": list(self.emitted_histogram),
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "draft_ms_per_step": round(self.draft_ms_per_step, 3),
            "verify_ms_per_step": round(self.verify_ms_per_step, 3),
            "recent_acceptance_rate": round(self.recent_acceptance_rate, 4),
            "recent_tokens_per_step": round(self.recent_tokens_per_step, 4),
        }


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
