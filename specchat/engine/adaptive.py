"""Adaptive K: per request, pick how many tokens to draft next from the acceptance seen so far.

A step that drafts k tokens emits 1 + sum_{j=1..k} prod_{i<=j} a_i tokens on average, where a_i is the chance
that draft i is accepted given that drafts 1..i-1 were (Leviathan et al. 2023, sec. 3.1, with one rate per
position instead of one for all: a head or a draft model gets worse the further it looks ahead). The step's
cost grows with k (drafting, and verifying k + 1 tokens instead of 1), here 1 + cost_per_draft * k plain
decode steps. The controller keeps an exponential moving average of each a_i over the positions actually
tested, and picks the k in [0, k_max] with the most tokens per unit of cost. When no k > 0 pays it stops
drafting and probes with k = 1 every `probe_every` steps, so that a change in the text (say, a code block
after prose) is noticed. A k the user sets bypasses this controller altogether (the engine keeps it fixed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specchat.errors import ConfigError

PRIOR_ACCEPTANCE = 0.6  # a_i before any evidence: optimistic enough to start drafting
EMA_WEIGHT = 0.3  # weight of the newest observation of a position
# One more draft token costs this fraction of a plain decode step: verifying it in the same target forward
# (memory-bound on weights, so nearly free on a GPU, more on a CPU) plus proposing it (heads: a slice of the
# lm_head; n-gram: nothing). Measured on the default model on CPU: see docs/speculative.md.
COST_PER_DRAFT = 0.1
PROBE_EVERY = 16


@dataclass(slots=True)
class AdaptiveK:
    k_max: int
    prior: float = PRIOR_ACCEPTANCE
    ema: float = EMA_WEIGHT
    cost_per_draft: float = COST_PER_DRAFT
    probe_every: int = PROBE_EVERY
    rates: list[float] = field(default_factory=list)  # a_1 .. a_kmax
    idle_steps: int = 0  # steps in a row without drafting

    def __post_init__(self) -> None:
        if self.k_max < 0 or not 0.0 < self.ema <= 1.0 or self.cost_per_draft < 0 or self.probe_every < 1:
            raise ConfigError("adaptive K: need k_max >= 0, 0 < ema <= 1, cost_per_draft >= 0, probe_every >= 1")
        if not self.rates:
            self.rates = [self.prior] * self.k_max

    @property
    def alpha(self) -> float:
        """Estimated acceptance of the first draft (what the UI shows as "acceptance now")."""
        return self.rates[0] if self.rates else 0.0

    def expected_tokens(self, k: int) -> float:
        """Mean tokens emitted by a step that drafts k tokens: 1 + sum_j prod_{i<=j} a_i."""
        total, reach = 1.0, 1.0
        for rate in self.rates[:k]:
            reach *= rate
            total += reach
        return total

    def best_k(self) -> int:
        gains = [self.expected_tokens(k) / (1 + self.cost_per_draft * k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=gains.__getitem__)

    def update(self, k: int, accepted: int) -> int:
        """Observe a step (k drafts, `accepted` kept) and return k for the next step."""
        # Positions 1..accepted were accepted; position accepted + 1 was tested and rejected (if it exists).
        for i in range(min(accepted + 1, k, self.k_max)):
            seen = 1.0 if i < accepted else 0.0
            self.rates[i] += self.ema * (seen - self.rates[i])
        nxt = self.best_k()
        if nxt > 0:
            self.idle_steps = 0
            return nxt
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every:
            self.idle_steps = 0
            return min(1, self.k_max)
        return 0
