"""The step loop: admit requests, draft, run one batched target forward, verify, emit events.

Every running request contributes the tokens it has not cached yet plus its drafts: a new prompt (or a chunk
of it) on its first steps, then [newest token, d_1..d_k]. Prefill, plain decode (k = 0), verification and
recomputation after preemption are therefore one code path. Invariant after a step that emitted tokens: the
KV cache holds every token but the newest (num_cached == num_tokens - 1).
"""

from __future__ import annotations

import time
from collections import deque

from specchat.engine.drafters import Draft, Drafter
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.engine.sequence import Event, Sequence, Status, StepEvent, TextDelta
from specchat.engine.stats import StepRecord
from specchat.engine.verify import verify
from specchat.errors import KVCacheFullError


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        drafter_for,  # Callable[[str], Drafter]
        max_running: int = 64,
        max_batch_tokens: int = 2048,
    ) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.drafter_for = drafter_for
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- queue ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cancel(self, seq_id: int) -> None:
        """Mark a request cancelled; the next step frees it and reports it finished."""
        for seq in (*self.waiting, *self.running):
            if seq.seq_id == seq_id and seq.finish_reason is None:
                seq.finish_reason = "cancelled"

    def _finish(self, seq: Sequence, events: list[Event]) -> None:
        if seq.status is Status.RUNNING:
            self.pool.free(seq.seq_id, seq.all_ids[: seq.num_cached])
            self.drafter_for(seq.spec.drafter).release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        delta = seq.take_delta()
        if delta:
            events.append(TextDelta(seq.seq_id, delta, []))
        events.append(seq.finish_event())

    def _admit(self, events: list[Event]) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = self.pool.pages_for(seq.num_tokens + seq.spec.k_max + 1)
            if need > self.pool.num_pages:
                self.waiting.popleft()
                seq.finish_reason, seq.status = "error", Status.FINISHED
                seq.error = (
                    f"request needs {seq.num_tokens} tokens of KV cache, the pool holds {self.pool.capacity_tokens}"
                )
                events.append(seq.finish_event())
                continue
            if need > self.pool.num_free_pages:
                break
            self.waiting.popleft()
            seq.num_cached = self.pool.add(seq.seq_id, seq.all_ids)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free a request's pages and queue it to be recomputed later; nothing it produced is lost."""
        self.pool.free(seq.seq_id, seq.all_ids[: seq.num_cached])
        self.drafter_for(seq.spec.drafter).release(seq)
        self.running.remove(seq)
        seq.num_cached = 0
        seq.hidden = {}
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    # --- one step -----------------------------------------------------------------------------------------
    def _draft_len(self, seq: Sequence) -> int:
        """k for this step, clipped so that the step cannot overrun max tokens or the context."""
        room = min(
            seq.sampling.max_tokens - len(seq.output_ids) - 1,
            seq.max_position - seq.num_tokens - 1,
        )
        return max(0, min(seq.k, room))

    def _plan(self) -> list[tuple[Sequence, list[int], int]]:
        """(request, uncached tokens to feed, k) for each request taking part in this step."""
        while True:
            plan, budget = [], self.max_batch_tokens
            for seq in self.running:  # decode first: their latency matters most
                if not seq.in_prefill and seq.num_cached == seq.num_tokens - 1:
                    k = self._draft_len(seq)
                    plan.append((seq, seq.all_ids[seq.num_cached :], k))
                    budget -= 1 + k
            for seq in self.running:  # prompts (all but their last token may come from the prefix cache)
                if (seq.in_prefill or seq.num_cached < seq.num_tokens - 1) and budget > 0:
                    chunk = seq.all_ids[seq.num_cached : seq.num_cached + budget]
                    plan.append((seq, chunk, 0))
                    budget -= len(chunk)
            needs = {s.seq_id: len(feed) + k for s, feed, k in plan}
            if self.pool.can_append(needs):
                return plan
            if len(self.running) == 1:
                raise KVCacheFullError("KV cache full: a single request does not fit the pool")
            self._preempt(self.running[-1])

    def step(self) -> list[Event]:
        events: list[Event] = []
        for seq in [s for s in (*self.waiting, *self.running) if s.finish_reason == "cancelled"]:
            self._finish(seq, events)
        self._admit(events)
        if not self.running:
            return events
        plan = self._plan()

        # Draft, one drafter at a time over the requests that use it.
        drafts: dict[int, Draft] = {}
        by_drafter: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, _, k in plan:
            if k > 0:
                by_drafter.setdefault(seq.spec.drafter, []).append((seq, k))
        taps: set[int] = set()
        draft_ms: dict[int, float] = {}
        for name, group in by_drafter.items():
            drafter: Drafter = self.drafter_for(name)
            taps.update(drafter.taps)
            g0 = time.perf_counter()
            for (seq, k), draft in zip(
                group, drafter.propose([s for s, _ in group], [k for _, k in group]), strict=True
            ):
                drafts[seq.seq_id] = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k])
                draft_ms[seq.seq_id] = (time.perf_counter() - g0) * 1e3
        for seq in self.running:
            taps.update(self.drafter_for(seq.spec.drafter).taps)

        # One target forward over every request's [uncached tokens + drafts].
        t1 = time.perf_counter()
        feeds, rows = [], []
        for seq, feed, _ in plan:
            d = drafts.get(seq.seq_id, Draft([])).tokens
            feeds.append(feed + d)
            completes = seq.num_cached + len(feed) == seq.num_tokens
            rows.append(1 + len(d) if completes else 0)
        batch = StepBatch([s.seq_id for s, _, _ in plan], feeds, [s.num_cached for s, _, _ in plan], rows)
        out = self.runner.forward(batch, taps=sorted(taps))

        for i, (seq, feed, _) in enumerate(plan):
            if rows[i] == 0:  # a chunk of a long prompt: cache it, nothing to sample yet
                seq.num_cached += len(feed)
                continue
            draft = drafts.get(seq.seq_id, Draft([]))
            k = len(draft.tokens)
            accepted, emitted = verify(out.logits[i], draft.tokens, draft.probs, seq.sampling, seq.generator)
            n_before = seq.num_tokens
            was_decode = len(feed) == 1 and seq.output_ids
            self.pool.truncate(seq.seq_id, n_before + accepted)
            seq.num_cached = n_before + accepted
            if taps:
                row = len(feeds[i]) - 1 - k + accepted
                seq.hidden = {layer: h[row] for layer, h in out.hidden[i].items()}
            kept = seq.append_tokens(emitted)
            verify_ms = (time.perf_counter() - t1) * 1e3
            if was_decode:
                # a stop token ends the output but was produced by this step all the same
                produced = len(kept) + (len(kept) < len(emitted) and seq.finish_reason == "stop")
                rec = StepRecord(k, accepted, produced, draft_ms.get(seq.seq_id, 0.0), verify_ms)
                seq.stats.observe_step(rec)
                if seq.adaptive:
                    seq.k = seq.adaptive.update(k, accepted, rec.draft_ms + rec.verify_ms)
                else:
                    seq.k = seq.spec.k or 0
                events.append(StepEvent(seq.seq_id, rec, seq.k))
            delta = seq.take_delta()
            if delta or kept:
                events.append(TextDelta(seq.seq_id, delta, kept))
            if seq.finish_reason is not None:
                self._finish(seq, events)
        return events
