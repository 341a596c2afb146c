"""The scheduler: which requests run in a step and with what (`schedule`), and what the step did to them
(`postprocess`). It never runs the model; engine.spec_step does, between the two.

Every running request contributes the tokens it has not cached yet plus its drafts: a new prompt (or a chunk
of it) on its first steps, then [newest token, d_1..d_k]. Prefill, plain decode (k = 0), verification and
recomputation after preemption are therefore one code path. Invariant after a step that emitted tokens: the
KV cache holds every token but the newest (num_cached == num_tokens - 1).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import torch

from specchat.engine.adaptive import GATE_CAPS, DraftGate, RateMemory, StepCosts, gain_margin
from specchat.engine.drafters import DrafterCache, NoDrafter
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import RowOf
from specchat.engine.sequence import Event, Sequence, Status, StepEvent, TextDelta
from specchat.engine.spec_step import Scheduled, StepPlan, StepResult
from specchat.engine.stats import StepRecord

GateKey = tuple[tuple[str, ...], int]


def gate_key(drafters: Iterable[str]) -> GateKey:
    """A batch's DraftGate key: its requests' drafters (what a step costs and accepts depends on them) and its
    size bucket (the next power of two)."""
    names = list(drafters)
    return tuple(sorted(set(names))), 1 << (len(names) - 1).bit_length()


class Scheduler:
    def __init__(
        self,
        pool: KVPool,
        drafters: DrafterCache,
        max_running: int = 64,
        max_batch_tokens: int = 2048,
        uniform_widths: bool = False,
        chunk_beside_decoding: int | None = None,
    ) -> None:
        self.pool = pool
        self.drafters = drafters
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        # a prompt's chunk in a step that also decodes requests, at most (None: max_batch_tokens): they wait on it
        self.chunk_beside_decoding = chunk_beside_decoding
        # the runner pads a step's requests to its widest (CUDA graphs): one request's big k widens them all
        self.uniform_widths = uniform_widths
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.costs = StepCosts()  # what decode steps cost on this device, for adaptive K
        self.memory = RateMemory()  # what finished adaptive requests learnt, per drafter, for the next ones
        # per (the batch's drafters, its size bucket): the cap on k that pays end to end (auto k)
        self.gates: dict[GateKey, DraftGate] = {}
        # the step being run, where its decoding requests all choose k adaptively: its gate, start, cap on k
        self._gated: tuple[DraftGate, float, int] | None = None
        # the last step to time: gate, cap on k, its expected tokens (DraftGate.expected_tokens), requests, start
        self._timed: tuple[DraftGate, int, float, int, float] | None = None
        # the gate and cap of the last step of decoding requests alone (None after any other step)
        self._steady: tuple[DraftGate, int] | None = None

    # --- queue ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live(self) -> list[Sequence]:
        """Every request not finished yet, waiting ones first."""
        return [*self.waiting, *self.running]

    def cancel(self, seq_id: int) -> None:
        """Mark a request cancelled; the next step frees it and reports it finished."""
        for seq in self.live():
            if seq.seq_id == seq_id and seq.finish_reason is None:
                seq.finish_reason = "cancelled"

    def _finish(self, seq: Sequence, events: list[Event]) -> None:
        if seq.adaptive is not None and not _seeded(seq):
            self.memory.remember(seq.spec.drafter, seq.adaptive)
        if seq.status is Status.RUNNING:
            self.pool.free(seq.seq_id, seq.all_ids[: seq.num_cached])
            self.drafters.release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        delta = seq.take_delta()
        if delta:
            events.append(TextDelta(seq.seq_id, delta, []))
        events.append(seq.finish_event())

    def _fail(self, seq: Sequence, error: str, events: list[Event]) -> None:
        """End one request with an error; the others go on."""
        seq.finish_reason, seq.error = "error", error
        self._finish(seq, events)

    # --- schedule ---------------------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[Event]]:
        """Finish cancelled requests, admit waiting ones, and plan the step (empty when nothing runs)."""
        now = time.perf_counter()
        if self._timed is not None:  # the previous step, from its start to this one's, host work included
            gate, limit, tokens, requests, start = self._timed
            gate.observe(limit, (now - start) * 1e3, tokens, requests)
            self._timed = None
        events: list[Event] = []
        for seq in [s for s in self.live() if s.finish_reason == "cancelled"]:
            self._finish(seq, events)
        self._admit(events)
        items = self._plan(events, now) if self.running else []
        # the next step may be launched ahead of this one's tokens where no admission can change it; adaptive
        # requests decode plainly in it too where their batch's gate keeps them from drafting now and next
        ahead = not self.waiting or len(self.running) >= self.max_running
        gated_next = self._gated_off and not self._gated[0].peek()
        running = self.running
        if gated_next:  # nobody drafts now or next: only drafters that need every position's rows (EAGLE) tap
            # (a step before a trial taps, so that the trial's first step drafts from the newest row), and requests
            # the gate does not hold (a fixed k, a seeded sampled request: `_adaptive_cap`) whose prompt ends now:
            # they draft next step, and a seeded one that skipped it would draw other numbers than alone
            history = {name: self.drafters.get(name).tap_history for name in {s.spec.drafter for s in running}}
            running = [s for s in running if history[s.spec.drafter] or not _gated(s)]
        return StepPlan(items, self.drafters.taps(running), ahead, gated_next), events

    def _admit(self, events: list[Event]) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            # room for its tokens, the next one, and as many drafts as it may ever verify in a step: none without a
            # drafter, and no more than its max tokens and the context leave (a prompt that fits with its whole
            # answer is admitted)
            drafts = self._draft_len(seq, seq.spec.k_max)
            need = self.pool.pages_for(seq.num_tokens + 1 + drafts)
            if need > self.pool.num_pages:
                also = f" and {drafts} for its next step's drafts" if drafts else ""
                self._fail(
                    seq,
                    f"request needs {seq.num_tokens + 1} tokens of KV cache{also}, the pool holds "
                    f"{self.pool.capacity_tokens} (raise --kv-memory)",
                    events,
                )
                continue
            if need > self.pool.num_free_pages:
                break
            self.waiting.popleft()
            seq.num_cached = self.pool.add(seq.seq_id, seq.all_ids)
            seq.status = Status.RUNNING
            if seq.adaptive is not None and not seq.adaptive.depths and not _seeded(seq):  # fresh, not preempted
                seq.k = self.memory.start(seq.spec.drafter, seq.adaptive, seq.k)
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free a request's pages and queue it to be recomputed later; nothing it produced is lost."""
        self.pool.free(seq.seq_id, seq.all_ids[: seq.num_cached])
        self.drafters.release(seq)
        self.running.remove(seq)
        seq.num_cached = 0
        seq.hidden = {}
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _draft_len(self, seq: Sequence, k: int | None = None) -> int:
        """k (default: the request's own) for this step, clipped so that the step cannot overrun max tokens or the
        context (0 without a drafter: nothing to reserve room for)."""
        k = seq.k if k is None else k
        # (k = 0 first, without a drafter lookup or draft_room: a step the gate holds at 0, most of a large batch's
        # on the GPU, whose steps are host-bound, asks it of every request)
        if k <= 0 or isinstance(self.drafters.get(seq.spec.drafter), NoDrafter):
            return 0
        return min(k, max(0, seq.draft_room))

    @property
    def _gated_off(self) -> bool:
        """Whether the step being run is one whose adaptive requests the gate keeps from drafting."""
        return self._gated is not None and not self._gated[2]

    @staticmethod
    def _decodes(seq: Sequence) -> bool:
        """Whether the request feeds only its newest token (and drafts) this step: its prompt is all cached."""
        return not seq.in_prefill and seq.num_cached == seq.num_tokens - 1

    def _adaptive_cap(self, now: float) -> int | None:
        """For a step whose decoding requests all choose k adaptively, a cap on their k: the one their batch
        size's DraftGate allows (0 where drafting does not pay). Where the runner pads to the widest, every
        adaptive request drafts the cap itself (room allowing, `_plan`), whatever its own controller chose, so the
        step has one width and can run ahead of the host (docs/gpu.md); elsewhere the cap bounds each one's own k.
        Measured on the H200: a lone request's controller held k = 0, so every trial of drafting timed plain
        steps and drafting never came back on (1.00x plain where k = 4 ran 1.39x). The controllers, timed by
        steps that did not run ahead, chose k = 0 in batches too, so capping the cap at the median of their k
        (the eighteenth to thirtieth sessions) made the gate's trials of drafting time plain steps that tapped
        hidden rows (at 8 sessions 0.04 drafts a request): drafting stayed off at 8 sessions (1.00x plain where
        k = 4 ran 1.26x) and swung by run. Every request at the cap lost at 32 sessions (0.68-0.86x plain, twenty-
        seventh and thirtieth sessions) until the gate asked drafting to beat plain decoding by a margin that grows
        with the batch (`gain_margin`; thirty-first session; docs/benchmarks.md).

        A request decoding alone is gated only where the runner pads widths (CUDA graphs): there a plain step
        runs ahead of the host and a drafting step cannot, which the request's own controller never sees (it
        times only steps that did not run ahead), so it kept drafting at 0.77-0.91x plain speed on the H200
        (docs/benchmarks.md, eighth lease); the gate times whole steps. Elsewhere (the CPU) the controller's
        step times are the whole step's and a gate would only add trials. A seeded sampled request keeps its
        batch ungated, as a fixed k does: its k decides its random draws, and the gate's caps come from timings."""
        self._gated = None
        decoding = [s for s in self.running if self._decodes(s)]
        fewest = 1 if self.uniform_widths else 2
        # a request at k = 0 with no controller (`none`, at any k; any drafter at --k 0) drafts nothing: it neither
        # needs a gate nor keeps one from the others
        drafting = [s for s in decoding if s.adaptive is not None or s.k > 0]
        if len(decoding) < fewest or not drafting or any(s.adaptive is None or _seeded(s) for s in drafting):
            return None
        key = gate_key(s.spec.drafter for s in decoding)
        gate = self.gates.get(key)
        if gate is None:
            gate = self.gates[key] = self._new_gate(key)
        limit = gate.allow()
        self._gated = (gate, now, limit)
        return limit

    def _new_gate(self, key: GateKey) -> DraftGate:
        """The DraftGate of a batch not seen yet: following the neighbouring bucket of the same drafters (half or
        twice the size) that has timed the most steps, if any has timed one, else a fresh gate; asking drafting
        for its bucket's margin over plain decoding (`gain_margin`)."""
        drafters, bucket = key
        around = ((drafters, bucket // 2), (drafters, 2 * bucket))
        neighbours = [g for k in around if (g := self.gates.get(k)) is not None and g.ms_per_token]
        margin = gain_margin(bucket)
        if not neighbours:
            return DraftGate(margin=margin, top=self._gate_top(drafters))
        return max(neighbours, key=lambda g: g.steps).follow(margin)

    def _gate_top(self, names: tuple[str, ...]) -> int:
        """The largest cap the gate of a batch of these drafters tries: where the runner pads widths (CUDA graphs)
        and every one of them drafts on the device, the deepest they all draft there (`Drafter.drafts_on_device`:
        a wider step is verified on the host and the next one cannot run ahead of it); else the largest cap. On
        the H200 the hybrid's cap 8 (the lookup drafting 8 beside four heads) was priced 1.35 / 1.95 / 3.11 / 1.43
        ms a token at batch 1 / 2 / 4 / 8 where its best cap was 0.65 / 0.91 / 0.99 / 0.80, and 16-21% of the
        bench's gated steps at 8 sessions ran under cap 8 (twenty-eighth session, docs/benchmarks.md)."""
        if not self.uniform_widths:
            return GATE_CAPS[-1]
        # (requests of `none` in the batch draft nothing: they bound nothing)
        drafters = [d for name in names if not isinstance(d := self.drafters.get(name), NoDrafter)]
        if not all(d.drafts_on_device() for d in drafters):
            return GATE_CAPS[-1]
        return max(cap for cap in GATE_CAPS if all(cap == 0 or d.drafts_on_device(cap) for d in drafters))

    def _plan(self, events: list[Event], now: float) -> list[Scheduled]:
        """The requests taking part in this step, preempting the newest ones until the pool holds the step."""
        cap = self._adaptive_cap(now)
        # on CUDA graphs every adaptive request of the step drafts its cap (_adaptive_cap): one width, so the step
        # can run ahead of the host
        uniform = cap is not None and self.uniform_widths
        while self.running:
            items, budget = [], self.max_batch_tokens
            for seq in self.running:  # decode first: their latency matters most
                if self._decodes(seq):
                    if seq.adaptive is not None:
                        seq.adaptive.capped = uniform
                    if cap is None or seq.adaptive is None:
                        k = self._draft_len(seq)
                    else:
                        k = self._draft_len(seq, cap) if uniform else min(self._draft_len(seq), cap)
                    items.append(Scheduled(seq, seq.tokens_from(seq.num_cached), k))
                    budget -= 1 + k
            if items and self.chunk_beside_decoding is not None:
                budget = min(budget, self.chunk_beside_decoding)
            for seq in self.running:  # prompts (all but their last token may come from the prefix cache)
                if (seq.in_prefill or seq.num_cached < seq.num_tokens - 1) and budget > 0:
                    chunk = seq.tokens_from(seq.num_cached, seq.num_cached + budget)
                    items.append(Scheduled(seq, chunk, 0))
                    budget -= len(chunk)
            if self.pool.can_append({item.seq.seq_id: len(item.feed) + item.k for item in items}):
                return items
            if len(self.running) == 1:  # alone and still too big: this request cannot run in this pool
                self._fail(
                    self.running[0],
                    f"KV cache full: the request grew to {self.running[0].num_tokens} tokens and its next step "
                    f"needs room for {sum(len(item.feed) + item.k for item in items)} more, the pool holds "
                    f"{self.pool.capacity_tokens} (raise --kv-memory)",
                    events,
                )
            else:
                self._preempt(self.running[-1])
        return []

    def fail(self, plan: StepPlan, error: str) -> list[Event]:
        """End every request of a step that could not run (its pages freed); the others are untouched."""
        return self._fail_all([item.seq for item in plan.items], error)

    def fail_all(self, error: str) -> list[Event]:
        """End every live request with `error` (the engine could not go on with them)."""
        return self._fail_all(self.live(), error)

    def _fail_all(self, seqs: list[Sequence], error: str) -> list[Event]:
        events: list[Event] = []
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                self._fail(seq, error, events)
        return events

    # --- postprocess ------------------------------------------------------------------------------------
    def _keep_hidden(self, seq: Sequence, hidden: dict) -> None:
        """Add the step's tapped rows to those the request's drafter has not read yet (only the newest row for a
        drafter without `tap_history`; a `RowOf` is that row already, kept as it is)."""
        if isinstance(hidden, RowOf):  # (made only for drafters without tap_history: SpecStep._verdicts_ahead)
            seq.hidden = hidden
        elif not self.drafters.get(seq.spec.drafter).tap_history:
            seq.hidden = {layer: h[-1:] for layer, h in hidden.items()}
        elif seq.hidden.keys() == hidden.keys():
            seq.hidden = {layer: torch.cat([seq.hidden[layer], h]) for layer, h in hidden.items()}
        else:
            seq.hidden = dict(hidden)

    def postprocess(self, plan: StepPlan, result: StepResult) -> list[Event]:
        """Apply a step's outcome to each request: KV kept, tokens, stats, next k, events, finished requests."""
        events: list[Event] = []
        decoding = sum(1 for o in result.outcomes if o is not None)
        if result.decoding:
            depth = max((o.drafted for o in result.outcomes if o is not None), default=0)
            if result.decode_rows is not None:  # (not a step that ran ahead: its times are not one step's)
                self.costs.observe(result.decode_rows, result.verify_ms, depth, result.draft_ms)
            # timed at the next schedule (if requests remain: no idle gap in it), and only a step of decoding
            # requests alone: one that also fed a prompt takes several decode steps' time (on the H200 such
            # steps, mostly under plain decoding, made plain look 1.7x slower than it ran, and drafting win);
            # and only one that follows a step of the same kind under the same cap: the first step after a
            # prompt or after a change of cap (a trial's first and the one after it) could not have been
            # launched ahead of the host, so it shows what neither steady plain decoding nor drafting costs;
            # nor the step before a trial of drafting, which taps hidden rows and cannot run ahead: its cost is the
            # trial's, and timed as plain decoding's it was the freshest plain time whenever a trial was judged
            # (on the H200 plain decoding was then priced ~15% above its steady steps: 1.08 / 1.25 ms per token
            # where its steps took 0.93 / 0.99 at 8 / 32 sessions; twenty-seventh session)
            if self._gated is not None:
                self._gated[0].observe_drafts((o.drafted, o.accepted) for o in result.outcomes if o is not None)
            before_trial = self._gated_off and not plan.gated_next
            alone = self._gated is not None and not before_trial and all(len(item.feed) == 1 for item in plan.items)
            steady = (self._gated[0], self._gated[2]) if alone else None
            if alone and steady == self._steady:
                gate, start, limit = self._gated
                tokens = gate.expected_tokens(o.drafted for o in result.outcomes if o is not None)
                self._timed = (gate, limit, tokens, decoding, start)
            self._steady = steady
        else:
            self._steady = None
        gated_off = self._gated_off
        for item, outcome, hidden in zip(plan.items, result.outcomes, result.hidden, strict=True):
            seq = item.seq
            if hidden:
                self._keep_hidden(seq, hidden)
            elif gated_off and seq.hidden:  # not tapped this step: the row it holds is no longer the newest
                seq.hidden = {}
            if outcome is None:  # a chunk of a long prompt: cached, nothing to sample yet
                seq.num_cached += len(item.feed)
                continue
            was_decode = len(item.feed) == 1 and seq.output_ids
            seq.num_cached = seq.num_tokens + outcome.accepted  # rejected drafts' keys/values are dropped
            # (a request whose next step runs ahead keeps the positions that step writes)
            keep = seq.num_cached + result.ahead.get(seq.seq_id, 0)
            if self.pool.lengths[seq.seq_id] != keep:  # (a step without drafts reserved just what it keeps)
                self.pool.truncate(seq.seq_id, keep)
            kept = seq.append_tokens(outcome.emitted)
            if was_decode:
                # a stop token ends the output but was produced by this step all the same
                produced = len(kept) + (len(kept) < len(outcome.emitted) and seq.finish_reason == "stop")
                rec = StepRecord(outcome.drafted, outcome.accepted, produced, result.draft_ms, result.verify_ms)
                seq.stats.observe_step(rec)
                if seq.adaptive is None:
                    seq.k = seq.spec.k or 0
                elif not gated_off:  # a step the gate held at k = 0 teaches the controller nothing
                    # the time of this step had every decode request drafted this request's k (StepCosts); not
                    # for its first decode step, whose drafting builds the n-gram index over the whole prompt and
                    # whose time the controller would keep for that k until it drafts as many again. A seeded
                    # sampled request chooses k from its acceptance alone: its k, and so its random draws, must not
                    # depend on how fast the machine ran (the same seed repeats the same text)
                    step_ms = None
                    if seq.stats.steps > 1 and not _seeded(seq):
                        step_ms = self.costs.symmetric_ms(decoding, rec.k) or rec.draft_ms + rec.verify_ms
                    seq.k = seq.adaptive.update(rec.k, rec.accepted, step_ms, outcome.source)
                events.append(StepEvent(seq.seq_id, rec, seq.k))
            delta = seq.take_delta()
            if delta or kept:
                events.append(TextDelta(seq.seq_id, delta, kept))
            if seq.finish_reason is not None:
                self._finish(seq, events)
        if not self.running:
            self._timed = None
        return events


def _gated(seq: Sequence) -> bool:
    """Whether a DraftGate may hold the request's k (`_adaptive_cap`): adaptive, and not seeded."""
    return seq.adaptive is not None and not _seeded(seq)


def _seeded(seq: Sequence) -> bool:
    """A seeded sampled request: the same seed must give the same text, so nothing timed may choose its k."""
    return seq.sampling.seed is not None and not seq.sampling.greedy
