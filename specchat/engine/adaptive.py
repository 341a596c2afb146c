"""Adaptive K: per request, pick how many tokens to draft next from the acceptance seen so far.

With per-token acceptance a and k drafts, a step emits (1 - a^(k+1)) / (1 - a) tokens on average
(Leviathan et al. 2023, eq. 1), while its cost grows with k (drafting, and verification of k + 1 tokens).
The controller keeps an exponential moving average of a and picks the k in [0, k_max] with the most tokens
per unit of cost. When no k > 0 pays it stops drafting and probes with k = 1 every `probe_every` steps so a
change in the text (say, a code block after prose) is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class AdaptiveK:
    k_max: int
    alpha: float = 0.6  # prior acceptance estimate
    ema: float = 0.3  # weight of the newest step
    cost_per_draft: float = 0.08  # step cost of one more draft token, relative to a plain decode step
    probe_every: int = 16
    idle_steps: int = 0

    def expected_tokens(self, k: int) -> float:
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def best_k(self) -> int:
        gains = [self.expected_tokens(k) / (1 + self.cost_per_draft * k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=gains.__getitem__)

    def update(self, k: int, accepted: int) -> int:
        """Observe a step (k drafts, `accepted` kept) and return k for the next step."""
        if k > 0:
            # The accepted prefix length estimates a: accepted tokens over the positions actually tested.
            tested = accepted + (1 if accepted < k else 0)
            self.alpha = (1 - self.ema) * self.alpha + self.ema * (accepted / tested)
        nxt = self.best_k()
        if nxt == 0:
            self.idle_steps += 1
            if self.idle_steps >= self.probe_every:
                self.idle_steps = 0
                return 1
        else:
            self.idle_steps = 0
        return nxt
