"""Adaptive K: per request, pick how many tokens to draft next from the acceptance and step times seen so far.

A step that drafts k tokens emits E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens on average, where a_i is the
chance that draft i is accepted given that drafts 1..i-1 were (Leviathan et al. 2023, sec. 3.1, with one rate
per position instead of one for all: a head or a draft model gets worse the further it looks ahead). The
controller keeps an exponential moving average of each a_i over the positions actually tested, and picks the
k in [0, k_max] with the most tokens per unit of time, E(k) / C(k), where C(k) is the step's time relative to
a plain step.

C(k) is measured, not assumed: what a draft costs depends on the drafter and, more, on the hardware. On the
default model on a CPU in fp32 a verification forward over 2..8 tokens takes ~1.8x a 1-token one (the small-M
GEMM path), while in bf16 it takes ~1.15x (see docs/speculative.md). So the controller keeps an EMA of the
step time at each k it has run, interpolates between them (and extrapolates with `cost_per_draft` per token),
and runs a plain step now and then to keep the reference time fresh. Without step times (a caller that
passes none) it uses C(k) = 1 + cost_per_draft * k.

A hybrid drafter (ngram+heads: an n-gram match where the context repeats, the heads elsewhere) draws its drafts
from sources that differ in kind: a match is free and right for several tokens, or absent; the heads are always
there and right less often. One set of rates would mix them: a run of head misses drove the rates from 0.9 to
0.1 within a few steps, k went to 0 and the n-gram lookup, which would have matched, was not asked (CPU, eval
prompts: 1.31 tokens per step on code against 2.65 at k = 4). So each named source of a draft (Draft.source)
keeps its own rates, each source drafts up to its own best k (`limit`), and the request reserves the largest.

When no k > 0 pays it stops drafting and probes with k = 1 every `probe_every` steps (a probe whose draft is
rejected goes straight back to idling), so that a change in the text (say, a code block after prose) is
noticed. A k the user sets bypasses this controller (the engine keeps it fixed). Step times make k, and so the
random draws of sampled verification, depend on timing, so a seeded sampled request gets none (engine/scheduler.py:
its k follows its acceptance alone and its batch is not gated): seeded sampling repeats exactly, adaptive or not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from specchat.errors import ConfigError

PRIOR_ACCEPTANCE = 0.6  # a_i before any evidence: optimistic enough to start drafting
EMA_WEIGHT = 0.3  # weight of the newest observation (the time of a step; a gate's)
# A request's controller: the newest acceptance weighs less and idle sources are probed twice as often as at first
# (0.3, 16): draft heads accept ~45% of drafts on code, in streaks, and at 0.3 three misses in a row took them to 0
# for 16 steps (CPU, eval code prompts, ngram+heads auto 0.93-0.97x the speed of k = 4, 1.00x at 0.15 and 8;
# docs/benchmarks.md, "Thirteenth session")
RATE_EMA_WEIGHT = 0.15
COST_PER_DRAFT = 0.1  # relative step cost of one more draft token where nothing was measured
MIN_COST_PER_DRAFT = 0.02  # a draft token is never free: the floor under noisy measurements (a busy machine)
PROBE_EVERY = 8  # idle steps between probes with k = 1
REMEASURE_PLAIN_EVERY = 64  # drafting steps between plain steps that refresh the reference time
SPIKE = 1.5  # a step time above SPIKE x its running estimate is a stall of the machine, not the cost of k
STALL_STEPS = 16  # ... unless this many come in a row: then the cost changed, and each counts at SPIKE x (fold_time)
MEMORY_WEIGHT = 0.5  # weight of a finished request in what its drafter's next request starts from (RateMemory)


def clamped_ema(old: float | None, ms: float, ema: float) -> float:
    """A running time (an EMA of weight `ema`) of a quantity that moves with the batch (a request's symmetric step
    time, the drafting time per position): a time above SPIKE x the running one counts as SPIKE x, so it follows
    a change of batch at once, a stall only in part."""
    return ms if old is None else old + ema * (min(ms, SPIKE * old) - old)


def fold_time(old: float | None, ms: float, slow: int, ema: float) -> tuple[float, int, float | None]:
    """One step's time folded into a running time (an EMA of weight `ema`), stalls of the machine left out: a
    time above SPIKE x the running one is left out unless STALL_STEPS come in a row (then the cost changed, and
    they count, each at most SPIKE x). `slow`: such times in a row before this one. Returns the running time, the
    count after this step and the time counted (None where left out).

    Taken at SPIKE x instead, each step of a burst of stalls (an H100 at one session: a dozen steps at 2-13x)
    raised the time of the k it fell on by a share, compounding; the choice then moved to another k, the burst
    fell on that one too, and the times of the k not chosen again stayed stalled (the draft gate priced drafting
    caps 40% above plain decoding for hundreds of steps where they ran 20-40% below it: on the H200 the heads at
    --k auto ran 1.15x plain where k = 4 ran 1.43x; fortieth session, benchmarks/gate_trace.py). For times of one
    shape only (a gate's cap in its batch bucket, a row count's forward): a time that moves with the batch takes
    clamped_ema."""
    if old is None or old <= 0.0:
        return ms, 0, ms
    slow = slow + 1 if ms > SPIKE * old else 0
    if 0 < slow < STALL_STEPS:
        return old, slow, None
    ms = min(ms, SPIKE * old)
    return old + ema * (ms - old), slow, ms


@dataclass(slots=True)
class AdaptiveK:
    k_max: int
    prior: float = PRIOR_ACCEPTANCE
    ema: float = RATE_EMA_WEIGHT
    cost_per_draft: float = COST_PER_DRAFT
    probe_every: int = PROBE_EVERY
    rates: list[float] = field(default_factory=list)  # a_1 .. a_kmax (drafts of the drafter's own source, "")
    sources: dict[str, list[float]] = field(default_factory=dict)  # rates of each other named source
    source_k: dict[str, int] = field(default_factory=dict)  # each source's best k ("" included) where sources
    depths: dict[str, int] = field(default_factory=dict)  # positions of each source ("" included) ever tested
    source_idle: dict[str, int] = field(default_factory=dict)  # steps in a row each source was not to draft
    source_probes: set[str] = field(default_factory=set)  # sources whose next draft is a probe of one token
    step_ms: list[float | None] = field(default_factory=list)  # EMA of the step time at k = 0 .. k_max
    idle_steps: int = 0  # steps in a row that chose not to draft
    since_plain: int = 0  # timed drafting steps since the last timed plain step
    probing: bool = False  # the step being observed is a probe
    # the step's k is its batch's gate's cap, which every request of the step drafts (CUDA graphs: one width, so
    # the step runs ahead of the host and its successor drafts on the device): every source drafts all of it.
    # (Per-source limits there let the request's own rates, which do not see steps run ahead, veto the gate's
    # trials: ngram+heads under --k auto drafted nothing on the H200, 1.00x plain where k = 4 ran 1.62x.)
    capped: bool = False
    # a drafter that decides each step's draft length by its own confidence (Drafter.gated_k): k is always this,
    # up to which it drafts; the rates are still kept (what the UI shows)
    fixed: int | None = None

    def __post_init__(self) -> None:
        if self.k_max < 0 or not 0.0 < self.ema <= 1.0 or self.cost_per_draft < 0 or self.probe_every < 1:
            raise ConfigError("adaptive K: need k_max >= 0, 0 < ema <= 1, cost_per_draft >= 0, probe_every >= 1")
        self.rates = self.rates or [self.prior] * self.k_max
        self.step_ms = self.step_ms or [None] * (self.k_max + 1)

    @classmethod
    def for_sources(cls, k_max: int, sources: tuple[str, ...] = (), gated_k: int | None = None) -> AdaptiveK:
        """A controller for a drafter whose drafts come from the named `sources` besides its own (""); `gated_k`:
        the drafter's own per-step gate decides how many of up to gated_k drafts it proposes (k stays gated_k)."""
        fixed = None if gated_k is None else min(gated_k, k_max)
        return cls(k_max, sources={name: [PRIOR_ACCEPTANCE] * k_max for name in sources}, fixed=fixed)

    def limit(self, source: str, k: int) -> int:
        """The most drafts `source` may propose in a step that reserved k: its own best k, 1 on its own probe, all
        k on the controller's probe or where k is its batch's cap (`capped`)."""
        if self.probing or self.capped or source not in self.source_k:
            return k
        return min(k, 1 if source in self.source_probes else self.source_k[source])

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

    def step_cost(self, k: int) -> float:
        """C(k): time of a step drafting k tokens over that of a plain step, from measured times where known.

        Never below 1 + MIN_COST_PER_DRAFT * k: a step that drafts does strictly more work than a plain one, and
        a plain step that happened to be slow (another process on the cores) must not make drafting look free.
        """
        return max(self._measured_cost(k), 1.0 + MIN_COST_PER_DRAFT * k)

    def _measured_cost(self, k: int) -> float:
        plain = self.step_ms[0]
        known = [j for j in range(1, self.k_max + 1) if self.step_ms[j] is not None]
        if k == 0:
            return 1.0
        if plain is None or not known:
            return 1.0 + self.cost_per_draft * k
        below = [j for j in known if j <= k]
        above = [j for j in known if j >= k]
        if below and above:  # measured, or between two measured k: interpolate
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self.step_ms[lo], self.step_ms[hi]
            t = t_lo if lo == hi else t_lo + (t_hi - t_lo) * (k - lo) / (hi - lo)
            return t / plain
        nearest = below[-1] if below else above[0]
        return max(1.0, self.step_ms[nearest] / plain + self.cost_per_draft * (k - nearest))

    def best_k(self, rates: list[float] | None = None) -> int:
        """argmax over k of expected_tokens(k) / step_cost(k), in one pass (it runs for every request at every
        step: ~27 us a request done term by term, a third of a 32-request GPU step's host time); `rates`: a
        source's, else the drafter's own."""
        rates = self.rates if rates is None else rates
        plain = self.step_ms[0]
        known = [j for j in range(1, self.k_max + 1) if self.step_ms[j] is not None]
        measured = plain is not None and known
        best, best_gain, total, reach, lo = 0, 1.0, 1.0, 1.0, 0
        for k in range(1, self.k_max + 1):
            reach *= rates[k - 1]
            total += reach
            if not measured:
                cost = 1.0 + self.cost_per_draft * k
            else:
                while lo + 1 < len(known) and known[lo + 1] <= k:
                    lo += 1
                j = known[lo]
                if j == k:  # measured
                    cost = self.step_ms[k] / plain
                elif j < k < known[-1]:  # between two measured k: interpolate
                    hi = known[lo + 1]
                    cost = (self.step_ms[j] + (self.step_ms[hi] - self.step_ms[j]) * (k - j) / (hi - j)) / plain
                else:  # beyond the measured ones: the nearest, plus cost_per_draft a token
                    nearest = j if j < k else known[0]
                    cost = max(1.0, self.step_ms[nearest] / plain + self.cost_per_draft * (k - nearest))
            gain = total / max(cost, 1.0 + MIN_COST_PER_DRAFT * k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def next_k(self) -> int:
        """The k to draft next from the current rates: the largest of the sources' best k (as `update` ends)."""
        if self.fixed is not None:
            return self.fixed
        nxt = self.best_k()
        if self.sources:
            self.source_k = {"": nxt} | {name: self.best_k(r) for name, r in self.sources.items()}
            nxt = max(self.source_k.values())
        return nxt

    def best_k_reference(self) -> int:
        """best_k term by term, from expected_tokens and step_cost (what the tests hold best_k to)."""
        gains = [self.expected_tokens(k) / self.step_cost(k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=gains.__getitem__)

    def update(self, k: int, accepted: int, step_ms: float | None = None, source: str = "") -> int:
        """Observe a step (k drafts from `source`, `accepted` kept, optionally its wall time) and return k for the
        next step: the largest of the sources' best k."""
        probed, self.probing = self.probing, False
        rates = self.sources.setdefault(source, [self.prior] * self.k_max) if source else self.rates
        # Positions 1..accepted were accepted; position accepted + 1 was tested and rejected (if it exists).
        tested = min(accepted + 1, k, self.k_max)
        for i in range(tested):
            seen = 1.0 if i < accepted else 0.0
            rates[i] += self.ema * (seen - rates[i])
        # Positions never tested take the deepest tested one's rate, not the prior: an n-gram match right for 2
        # tokens at a time is likely right for the next too, and a k that never drafts 3 never learns it is
        # (CPU, eval code prompts: the n-grams stayed at k = 2 with the deeper rates at the prior).
        depth = max(self.depths.get(source, 0), tested)
        self.depths[source] = depth
        if 0 < depth < self.k_max:
            rates[depth:] = [rates[depth - 1]] * (self.k_max - depth)
        if self.fixed is not None:
            return self.fixed
        if step_ms is not None and k <= self.k_max:
            # Another process on the cores stalls a step now and then; such spikes would make one k look cheap
            # against a stalled reference, so a time is taken at most SPIKE x the estimate (slower drifts still show;
            # the time is mostly StepCosts.symmetric_ms, whose forward times leave stalls out, and moves with the batch).
            self.step_ms[k] = clamped_ema(self.step_ms[k], step_ms, self.ema)
            self.since_plain = 0 if k == 0 else self.since_plain + 1
            if k > 0 and (self.step_ms[0] is None or self.since_plain >= REMEASURE_PLAIN_EVERY):
                return 0  # one plain step to (re)measure the reference time
        if probed and accepted == 0:  # a failed probe: back to idling, not k = 1 until the first rate decays
            self.idle_steps += 1
            return 0
        self.source_probes.discard(source)
        nxt = self.next_k()
        if self.sources:
            self._probe_idle_sources()
            nxt = max(self.source_k.values())
        if nxt > 0:
            self.idle_steps = 0
            return nxt
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every:
            self.idle_steps, self.probing = 0, self.k_max > 0
            return min(1, self.k_max)
        return 0

    def _probe_idle_sources(self) -> None:
        """A source that is not to draft while another drafts (so the controller as a whole never idles and
        never probes) gets its own probe of one draft every `probe_every` steps: a run of head misses early in
        a code answer otherwise silenced the heads for the rest of it while the n-grams kept drafting (CPU, with
        the depth rule in update: ngram+heads auto on chat 1.07x -> 1.40x plain; docs/benchmarks.md, "Thirteenth
        session"). The probe waits for a step where that source drafts.
        Where no source is to draft, the controller idles and its own probes let every source draft."""
        if not any(self.source_k.values()):
            self.source_probes.clear()
            self.source_idle.clear()
            return
        for name, k in self.source_k.items():
            if k > 0:
                self.source_idle[name] = 0
                self.source_probes.discard(name)
                continue
            if name not in self.source_probes:  # (one waiting for a step where it drafts counts no idle steps)
                idle = self.source_idle.get(name, 0) + 1
                if idle >= self.probe_every:
                    idle = 0
                    self.source_probes.add(name)
                self.source_idle[name] = idle
            if name in self.source_probes:
                self.source_k[name] = 1


@dataclass(slots=True)
class RateMemory:
    """What finished requests learnt of each drafter, for its next request to start from: a chat's next turn or a
    batch's next request would otherwise start at the optimistic prior and draft long until its own misses taught
    it (CPU, heads alone: a 128-token answer spent its first ~15 steps at k = 2..4 where k = 1 pays). Per drafter
    and draft source: the acceptance rates, folded over finished requests with MEMORY_WEIGHT on the newest, the
    deepest position tested, and the newest request's step times. Seeded sampled requests neither teach nor learn
    from it (their k must not depend on what ran before them: scheduler._seeded)."""

    weight: float = MEMORY_WEIGHT
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (drafter, source) -> a_1 .. a_kmax
    depths: dict[tuple[str, str], int] = field(default_factory=dict)
    step_ms: dict[str, list[float | None]] = field(default_factory=dict)  # drafter -> step times at k = 0 .. k_max

    def remember(self, drafter: str, controller: AdaptiveK) -> None:
        """Fold in what a finished request's controller learnt (only the sources it tested)."""
        for source, depth in controller.depths.items():
            rates = controller.rates if source == "" else controller.sources[source]
            key = (drafter, source)
            old = self.rates.get(key)
            if old is None or len(old) != len(rates):
                self.rates[key] = list(rates)
            else:
                self.rates[key] = [o + self.weight * (r - o) for o, r in zip(old, rates, strict=True)]
            self.depths[key] = max(self.depths.get(key, 0), depth)
        if any(t is not None for t in controller.step_ms):
            self.step_ms[drafter] = list(controller.step_ms)

    def start(self, drafter: str, controller: AdaptiveK, k: int) -> int:
        """Start a request's fresh controller from what its drafter's finished requests learnt; returns its first
        k (`k`, the caller's default, where nothing was learnt yet)."""
        learnt = False
        for source in ("", *controller.sources):
            rates = self.rates.get((drafter, source))
            if rates is None or len(rates) != controller.k_max:
                continue
            if source:
                controller.sources[source] = list(rates)
            else:
                controller.rates = list(rates)
            controller.depths[source] = self.depths[(drafter, source)]
            learnt = True
        times = self.step_ms.get(drafter)
        if times is not None and len(times) == controller.k_max + 1:
            controller.step_ms = list(times)
        return controller.next_k() if learnt or controller.fixed is not None else k


@dataclass(slots=True)
class StepCosts:
    """What a decode step costs on this device, learnt from the steps the engine runs: the time of the target's
    forward + verification as a function of the rows it verifies (batch x (1 + k), padding included), and the
    drafting time per draft position. Shared by every request of an engine.

    A request alone cannot see what its k costs once it shares the step with others: its own k adds only a few
    rows to a big batch, while every request drafting the same adds k rows each. So each request's controller is
    fed the time of the *symmetric* step, `symmetric_ms(batch, k)`: every decode request of the batch drafting k.
    At batch 1 that is its own step time; at high batch, where the target is compute-bound and verifying
    batch x (1 + k) rows costs about 1 + k plain steps, it shows that drafting does not pay there, and k goes to 0.
    """

    ema: float = EMA_WEIGHT
    verify_ms: dict[int, float] = field(default_factory=dict)  # rows -> EMA of the forward + verify time
    draft_ms_per_position: float | None = None  # EMA of a step's drafting time over its deepest draft
    slow: dict[int, int] = field(default_factory=dict)  # stalled steps in a row per row count (fold_time)

    def observe(self, rows: int, verify_ms: float, depth: int, draft_ms: float) -> None:
        """A decode step (no prompt chunk in it) verified `rows` rows in verify_ms and drafted `depth` deep."""
        self.verify_ms[rows], self.slow[rows], _ = fold_time(
            self.verify_ms.get(rows), verify_ms, self.slow.get(rows, 0), self.ema
        )
        if depth > 0:  # (one time for every batch size: it moves with the batch)
            self.draft_ms_per_position = clamped_ema(self.draft_ms_per_position, draft_ms / depth, self.ema)

    def forward_ms(self, rows: int) -> float | None:
        """Interpolated between measured row counts; past the largest, proportional to the rows (compute-bound);
        below the smallest, the smallest's time (memory-bound). None before any measurement."""
        if not self.verify_ms:
            return None
        known = sorted(self.verify_ms)
        if rows in self.verify_ms:
            return self.verify_ms[rows]
        below = [r for r in known if r < rows]
        above = [r for r in known if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self.verify_ms[lo], self.verify_ms[hi]
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        if above:
            return self.verify_ms[above[0]]
        return self.verify_ms[below[-1]] * rows / below[-1]

    def symmetric_ms(self, batch: int, k: int) -> float | None:
        """Step time if each of `batch` decode requests drafted k tokens (None while nothing was measured)."""
        forward = self.forward_ms(batch * (1 + k))
        if forward is None:
            return None
        return forward + k * (self.draft_ms_per_position or 0.0)


GATE_CAPS = (0, 1, 2, 4, 8)  # the caps on k a DraftGate chooses between for its batch (0: plain decoding)
FIRST_TRIAL_AFTER = 32  # plain steps before the first trial of drafting
RAMP_AFTER = 16  # steps at a cap before the first trial of twice that cap
TRIAL_EVERY = 256  # steps at the preferred cap between trials of another, after a trial that changed the choice
MAX_TRIAL_EVERY = 2048  # ... doubling after each trial that confirmed it, up to this
TRIAL_STEPS = 8  # steps of a trial
TRIAL_SHARE = 0.01  # after a trial that confirmed the choice: at most this share of the time goes to the next
CLIMB_MARGIN = 0.05  # from plain decoding, a cap timed at most this much slower than plain is worth twice it
CLIMB_GAIN = 0.03  # ... and twice a cap c > 1 is tried only where c was timed this much faster than c / 2
GAIN_MARGIN = 0.1  # a cap is preferred to plain decoding only where timed this much faster (per 8 requests)
MARGIN_BATCH = 8  # batch buckets larger than this ask drafting for a margin larger in proportion (`gain_margin`)
MAX_GAIN_MARGIN = 0.5  # ... at most this (drafting twice as fast as plain decoding)
SWITCH_MARGIN = 0.05  # from one drafting cap to another only where that is timed at least this much faster
ACCEPT_DECAY = 0.02  # what a gate's draft counts lose a drafting step: about the last 50 steps' drafts count


def gain_margin(batch: int) -> float:
    """How much faster than plain decoding a cap must be timed for a batch of this many requests (the scheduler
    passes its gate's bucket, the next power of two: 9 requests ask for 20%) to prefer it: GAIN_MARGIN up to
    MARGIN_BATCH requests, in proportion beyond (at most MAX_GAIN_MARGIN). What a gate's steady
    steps leave out grows with the batch: on the H200 (thirty-first session) drafting's steady steps were 28%
    faster a token than plain decoding's at 8 sessions where the run gained 12-22%, and the hybrid's at 32 were
    timed faster enough to draft 22% of the steps of a run that went 0.80x plain; every request that ends or
    arrives costs a step that cannot run ahead, and drafting spreads their ends over more steps."""
    return min(MAX_GAIN_MARGIN, GAIN_MARGIN * max(1.0, batch / MARGIN_BATCH))


@dataclass(slots=True)
class DraftGate:
    """How much a batch of adaptive-k requests of one size may draft, end to end, on this device: a cap on their
    k among GATE_CAPS (0: plain decoding).

    Each request's AdaptiveK prices its own k with a model of the step (StepCosts); what that model leaves out —
    the drafter's and the verification's host work per request, the steps that refill slots at different times
    when requests end at different steps, and on CUDA graphs the plain steps that run ahead of the host, which a
    drafting step cannot — is what makes a batch of requests that each "pay" slower than plain decoding (on the
    H200 at 32 sessions: 0.56x). So the scheduler also times whole steps of decoding requests alone (no prompt fed
    beside them), from one schedule to the next, and keeps milliseconds per emitted token for the steps run under
    each cap (an EMA of their time over an EMA of their tokens), per batch size bucket and set of drafters
    (`scheduler.gate_key`):
    milliseconds per token *of one request* (step time over tokens per request), so that steps of 17 and of 32
    requests in one bucket compare by what each request waits, not by how many requests shared the step. The
    tokens are those the step's drafts emit on average by the acceptance this bucket measured at each draft
    position (`expected_tokens`), not those it emitted: steps are timed one by one, tokens need many. A step
    is timed under the cap it was allowed, whether or not its requests drafted: allowed to draft, it could not
    run ahead.

    The preferred cap is the one timed fastest, plain decoding until another is by `margin` (ties go to the
    smaller cap); between drafting caps the one chosen last (`chosen`) stays unless another is SWITCH_MARGIN
    faster.
    Trials of TRIAL_STEPS steps time the others: from plain decoding, cap 1 after FIRST_TRIAL_AFTER steps (then
    twice the largest cap timed, RAMP_AFTER steps on, while drafting more got faster: `_from_plain`); from
    a cap c > 0, twice c after RAMP_AFTER steps while that is untimed (so a batch where drafting pays climbs
    1 -> 2 -> 4 -> 8 in a few dozen steps), then, every TRIAL_EVERY steps, plain decoding and twice c in turn.
    The interval doubles after each trial that leaves the choice as it was (up to MAX_TRIAL_EVERY), and is at
    least long enough that a trial costing what the last one did takes TRIAL_SHARE of the steps' time; it falls
    back when one changes the choice. Requests start from small caps because their own controllers learnt
    nothing while the gate held them: a first trial at k = 4 of 32 requests on the H200 ran each step at about
    half speed. So a change (new requests, new text) still shows, and where plain decoding stays better the
    trials' cost fades toward TRIAL_SHARE. A bucket seen for the first time starts from its neighbour's choice
    (`follow`), not afresh. (The scheduler times only steady steps: decoding requests alone, after a step of
    the same kind under the same cap.)
    """

    ema: float = EMA_WEIGHT
    margin: float = GAIN_MARGIN  # how much faster than plain decoding a preferred cap is timed (`gain_margin`)
    chosen: int = 0  # the cap preferred at the last step outside a trial
    # the largest cap it tries (the scheduler's `_gate_top`: on CUDA graphs the deepest its drafters draft on the
    # device, since a wider step cannot run ahead)
    top: int = GATE_CAPS[-1]
    ms_per_token: dict[int, float] = field(default_factory=dict)  # cap -> EMA of the time over EMA of the tokens
    # cap -> (EMA of a step's milliseconds x requests, EMA of its tokens): what ms_per_token divides
    sums: dict[int, tuple[float, float]] = field(default_factory=dict)
    since_trial: int = 0  # steps at the preferred cap since the last trial
    trial_left: int = 0  # steps of the running trial
    trial_cap: int = 0  # the cap of the running trial
    every: int = TRIAL_EVERY  # steps between trials now
    before_trial: int | None = None  # the preferred cap when the last trial started, until it is judged
    toward_plain: bool = True  # from a cap > 0 with twice it timed: whether its next trial is of plain decoding
    prior: dict[int, float] = field(default_factory=dict)  # cap -> time relative to the best, from a neighbour
    steps: int = 0  # steps timed (not those left out as stalls)
    step_ms: dict[int, float] = field(default_factory=dict)  # cap -> EMA of its steps' own time (fold_time)
    slow: dict[int, int] = field(default_factory=dict)  # cap -> its stalled steps in a row (fold_time)
    allowed: dict[int, int] = field(default_factory=dict)  # cap -> steps it was allowed (what benchmarks report)
    # position i (from 1) -> decayed counts of the drafts there and of those accepted (drafts 1..i all kept)
    drafted: list[float] = field(default_factory=lambda: [0.0] * GATE_CAPS[-1])
    accepted: list[float] = field(default_factory=lambda: [0.0] * GATE_CAPS[-1])

    def follow(self, margin: float = GAIN_MARGIN) -> DraftGate:
        """A gate for a new batch-size bucket next to this one, starting from what this one learnt: its preferred
        cap and the other caps' times in proportion (scaled to the new bucket by the first cap the new gate
        times), so that its first trial comes TRIAL_EVERY steps on. A new bucket is mostly a batch that shrank as
        requests ended (or grew as they came); starting afresh, it would spend its first 32 steps at plain
        decoding and then a trial of drafting, which in the short tail of a batch is a large share of its steps.
        (The neighbour's own, possibly longer, interval is not taken: a choice wrong at this size shows within
        TRIAL_EVERY steps.) `margin`: the new bucket's (`gain_margin`)."""
        best = min(self.ms_per_token.values())
        return DraftGate(
            ema=self.ema,
            margin=margin,
            top=self.top,
            toward_plain=self.toward_plain,
            prior={cap: ms / best for cap, ms in self.ms_per_token.items()},
            chosen=self.chosen,
            drafted=list(self.drafted),
            accepted=list(self.accepted),
        )

    def preferred(self) -> int:
        """The cap timed with the fewest milliseconds per token (0 while nothing else is timed), and plain decoding
        unless that cap is timed at least `margin` faster than it.

        A gate's times are EMAs of the last few steady steps of each cap, taken minutes apart, and they leave out
        what drafting costs beyond its steady steps (steps that feed prompts, and the first steps after each change
        of cap, which cannot run ahead): on the H200 at 32 sessions, with every request drafting the gate's cap,
        the gate priced caps 1-4 at 1.24-1.26 ms a token against plain decoding's 1.28 where their steady steps
        took 1.08-1.23 against plain's 1.02 (and steps feeding prompts 2.6-4.5 ms against 1.7), and the run went
        0.75-0.98x plain; at 8 sessions drafting's steady steps took 0.73 ms a token against 1.02 (docs/benchmarks.md,
        thirty-first session). A margin keeps plain decoding where drafting's gain is within the noise of its
        timing, at the cost of gains smaller than it; larger batches ask for more (`gain_margin`). Between two
        drafting caps the one chosen last stays unless the other is timed SWITCH_MARGIN faster."""
        times = self.ms_per_token or self.prior
        if not times:
            return 0
        best = int(min(times, key=lambda cap: (times[cap], cap)))
        plain = times.get(0)

        def beats_plain(cap: int) -> bool:
            return plain is None or times[cap] <= plain * (1.0 - self.margin)

        if best and not beats_plain(best):
            return 0
        held = self.chosen  # each change of width is a step that cannot run ahead: not for a gain within the noise
        if best and held not in (0, best) and held in times and beats_plain(held):
            return held if times[best] > times[held] * (1.0 - SWITCH_MARGIN) else best
        return best

    def _target(self, preferred: int, every: int) -> tuple[int, int]:
        """(the cap the next trial tries, steps at the preferred cap before it starts, `every` if timed)."""
        up = min(2 * preferred, self.top)
        if preferred == 0:
            target = self._from_plain()
        elif up == preferred:  # the top cap: only plain decoding is left to try
            target = 0
        else:  # twice the cap while untimed, then plain decoding and twice the cap in turn
            target = up if up not in self.ms_per_token or not self.toward_plain else 0
        if target in self.ms_per_token:
            return target, every
        return target, FIRST_TRIAL_AFTER if target == GATE_CAPS[1] else RAMP_AFTER

    def _from_plain(self) -> int:
        """The cap a trial from plain decoding tries: cap 1 first; twice the largest cap timed while drafting
        more got faster (cap 1 within CLIMB_MARGIN of plain decoding, each larger cap CLIMB_GAIN faster than half
        it): a batch where one draft barely pays but four do (the H200 at 8 sessions: a first trial at cap 1 timed
        a little slower than plain held some runs at plain decoding, 0.95x where k = 4 ran 1.06-1.16x); else the
        fastest cap timed. (On the H200 at 32 sessions caps 1 and 2 were timed within 0.3% of each other, short
        of the batch's margin over plain decoding, and the climb to cap 4 went on: 27 of the heads' 49 steps of
        trials in a run, each trial spreading the requests' ends, whose slots then refill one by one in steps that
        cost 1.7-4 ms against 1.0; forty-third session, docs/benchmarks.md.)"""
        times = self.ms_per_token
        drafting = [cap for cap in GATE_CAPS[1:] if cap in times]
        if not drafting:
            return GATE_CAPS[1]
        top = drafting[-1]
        below = times.get(top // 2 if top > 1 else 0)
        faster = below is not None and times[top] < below * (1.0 + CLIMB_MARGIN if top == 1 else 1.0 - CLIMB_GAIN)
        if faster and top < self.top and 2 * top not in times:
            return 2 * top
        return min(drafting, key=lambda cap: (times[cap], cap))

    def _next(self) -> tuple[int, int, int | None]:
        """The next step's (preferred cap, trial interval, cap of a trial that starts or None), outside a running
        trial: the interval as judging a finished trial leaves it (one decision for peek and allow)."""
        preferred = self.preferred()
        every = self.every
        if self.before_trial is not None:  # the trial's steps are all observed: did it change the choice?
            every = self._confirmed_every(preferred) if preferred == self.before_trial else TRIAL_EVERY
        target, wait = self._target(preferred, every)
        return preferred, every, target if self.since_trial + 1 > wait else None

    def _confirmed_every(self, preferred: int) -> int:
        """The interval after a trial that left `preferred` preferred: twice the last, and long enough that the
        next trial, if it costs what this one measured (TRIAL_STEPS steps at its time per token against the
        preferred cap's), takes at most TRIAL_SHARE of the steps' time; at most MAX_TRIAL_EVERY. (A trial of a
        cap twice as slow as plain decoding, at TRIAL_EVERY steps, costs 3%: on the H200 at 8 sessions the
        drafters ran 0.94-0.97x plain.)"""
        every = 2 * self.every
        tried, best = self.ms_per_token.get(self.trial_cap), self.ms_per_token.get(preferred)
        if tried is not None and best:
            every = max(every, math.ceil(TRIAL_STEPS * (tried / best - 1) / TRIAL_SHARE))
        return min(every, MAX_TRIAL_EVERY)

    def peek(self) -> bool:
        """Whether the next step may draft, as `allow` will say, as far as the timings known now tell."""
        if self.trial_left > 0:
            return self.trial_cap > 0
        preferred, _, trial = self._next()
        return (preferred if trial is None else trial) > 0

    def allow(self) -> int:
        """The cap on the k of the adaptive requests of the next step, 0 for none (advances the trial schedule)."""
        cap = self._allow()
        self.allowed[cap] = self.allowed.get(cap, 0) + 1
        return cap

    def _allow(self) -> int:
        if self.trial_left > 0:
            self.trial_left -= 1
            return self.trial_cap
        preferred, self.every, trial = self._next()
        self.chosen = preferred
        self.before_trial = None
        self.since_trial += 1
        if trial is None:
            return preferred
        self.toward_plain = trial != 0  # from a cap > 0 the next trial tries the other neighbour
        self.since_trial, self.trial_left, self.trial_cap, self.before_trial = 0, TRIAL_STEPS - 1, trial, preferred
        return trial

    def observe_drafts(self, drafts: Iterable[tuple[int, int]]) -> None:
        """A step of this bucket's requests drafted and kept (drafted, accepted) tokens per request."""
        drafts = [(min(d, len(self.drafted)), a) for d, a in drafts if d > 0]
        if not drafts:
            return
        keep = 1.0 - ACCEPT_DECAY
        self.drafted = [n * keep for n in self.drafted]
        self.accepted = [n * keep for n in self.accepted]
        for depth, kept in drafts:
            for i in range(depth):
                self.drafted[i] += 1.0
                self.accepted[i] += i < kept

    def expected_tokens(self, depths: Iterable[int]) -> float:
        """The tokens a step whose requests drafted `depths` emits on average, from the drafts this bucket kept:
        per request 1 + the sum over its draft positions i of the share of drafts at i accepted (with i - 1
        before them), a prior of PRIOR_ACCEPTANCE weighing as one draft, and never above the share at i - 1.

        The gate prices a cap with this, not with the tokens its steps happened to emit: those vary from 1 to
        k + 1 a request, so at one session a cap's time per token swung by ~25% over a trial, the preferred cap
        followed whichever cap had been lucky, and a cap that stopped being preferred kept its unlucky time
        (simulated at one session, drafting 1.7x faster than plain at k = 4: the gate ran 1.07x plain, mostly
        plain decoding; tests/engine/test_adaptive.py). The counts pool every drafting step's positions, at
        whatever cap."""
        depths = list(depths)
        if not any(depths):  # a step the gate held at k = 0 (most of a large batch's on the GPU): one token each
            return float(len(depths))
        reach, share = [1.0], 1.0  # reach[d]: the tokens a request drafting d emits on average
        for a, n in zip(self.accepted, self.drafted, strict=True):
            # the share of requests whose first i drafts are all kept cannot grow with i; a deep position drafted
            # a few times reads mostly the prior, and priced a cap's steps as if they kept ~0.6 a position there
            share = min(share, (a + PRIOR_ACCEPTANCE) / (n + 1.0))
            reach.append(reach[-1] + share)
        return sum(reach[min(d, len(reach) - 1)] for d in depths)

    def observe(self, cap: int, step_ms: float, tokens: float, requests: int = 1) -> None:
        """A decode step of `requests` requests in this bucket, allowed to draft up to `cap` tokens each, took
        step_ms, host work included, for `tokens` in all (`expected_tokens`)."""
        if tokens <= 0:
            return
        # Stalls of the machine are left out (fold_time), judged by the step's own time against its cap's: its
        # time x requests varies with the requests of the bucket's steps (17 to 32, say).
        self.step_ms[cap], self.slow[cap], counted = fold_time(
            self.step_ms.get(cap), step_ms, self.slow.get(cap, 0), self.ema
        )
        if counted is None:
            return
        ms = counted * requests
        # A ratio of averages, not an average of each step's ratio: a drafting step emits 1..k + 1 tokens per
        # request, and the mean of time / tokens over such steps exceeds their mean time over their mean tokens
        # (at one session with ~1.9 tokens a step by ~20%), which priced drafting caps above what they cost
        # against plain steps (always one token) and held the gate at smaller caps than k = 4 (H200, one
        # session: --k auto 1.38x plain where k = 4 ran 1.62x; docs/benchmarks.md, twenty-fifth session).
        # The cap's running (ms, tokens); a time set directly (from a neighbour's) is one step of this one's tokens.
        old = self.sums.get(cap) or ((self.ms_per_token[cap] * tokens, tokens) if cap in self.ms_per_token else None)
        if old is None:
            self.sums[cap] = (ms, tokens)
        else:
            old_ms, old_tokens = old
            self.sums[cap] = (
                old_ms + self.ema * (ms - old_ms),
                old_tokens + self.ema * (tokens - old_tokens),
            )
        self.ms_per_token[cap] = self.sums[cap][0] / self.sums[cap][1]
        self.steps += 1
        if cap in self.prior:  # the neighbour's other caps, in proportion to this one's first time here
            scale = self.ms_per_token[cap] / self.prior[cap]
            for other, ratio in self.prior.items():
                self.ms_per_token.setdefault(other, ratio * scale)
            self.prior = {}
