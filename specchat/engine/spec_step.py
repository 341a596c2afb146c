"""One speculation step over the whole batch: draft -> one target forward -> verify, with one device sync.

Input is the scheduler's StepPlan: for each request the tokens it feeds (a prompt chunk, or its newest token)
and how many drafts it may propose (k). Each drafter proposes for all of its requests at once; the target then
runs once over every request's [fed tokens + drafts] (verification and plain decoding are the same forward,
k = 0 being plain), and `verify_batch` decides all requests' accepted drafts and recovered / bonus tokens with a
single copy to the host. Nothing here touches a request's state: `Scheduler.postprocess` applies the result.

Timing (what StepRecord carries): every request of the step waited for the whole step, so each one is charged
the step's drafting time (draft_ms) and its forward + verification time (verify_ms): the wall time between its
tokens. Both are measured once per step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from specchat.engine.drafters import Draft, DrafterCache
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.engine.sequence import Sequence
from specchat.engine.verify import verify_batch

PAD_TOKEN = 0  # fills a padded request's rows past its drafts; their logits are never read


@dataclass(slots=True)
class Scheduled:
    """One request's part in a step: the uncached tokens it feeds and the most drafts it may propose."""

    seq: Sequence
    feed: list[int]
    k: int

    @property
    def samples(self) -> bool:
        """Whether the step ends at the request's newest token (a mid-prompt chunk only fills the cache)."""
        return self.seq.num_cached + len(self.feed) == self.seq.num_tokens


@dataclass(slots=True)
class StepPlan:
    """What the scheduler decided for one step."""

    items: list[Scheduled] = field(default_factory=list)
    taps: tuple[int, ...] = ()  # target layers whose hidden states some running request's drafter reads


@dataclass(slots=True)
class Outcome:
    """What the step gave one request that samples (terms as in engine.verify)."""

    drafted: int  # draft tokens proposed (may be fewer than the plan's k)
    accepted: int
    emitted: list[int]  # accepted drafts + the recovered or bonus token


@dataclass(slots=True)
class StepResult:
    outcomes: list[Outcome | None]  # per plan item; None for a prompt chunk that samples nothing
    # per plan item: {tap layer: [rows, d]} for the positions the step processed and kept (a chunk's every
    # token; the fed tokens up to the last accepted draft otherwise); empty when no drafter taps
    hidden: list[dict[int, torch.Tensor]]
    draft_ms: float
    verify_ms: float
    decode_rows: int | None = None  # rows the target verified in a step of decoding only (padding included)


class SpecStep:
    """Drafts, runs the target and verifies, for every request of a plan at once."""

    def __init__(self, runner: ModelRunner, drafters: DrafterCache) -> None:
        self.runner = runner
        self.drafters = drafters

    def run(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        drafts = self.draft(plan)
        t1 = time.perf_counter()
        feeds = [item.feed + drafts[i].tokens for i, item in enumerate(plan.items)]
        rows = [1 + len(drafts[i].tokens) if item.samples else 0 for i, item in enumerate(plan.items)]
        decoding = [item.samples and len(item.feed) == 1 for item in plan.items]
        width = self._padded_width(plan, rows, decoding)
        logit_rows = list(rows)
        if width is not None:  # pad the decoding requests' drafts to one width; the extra rows are never verified
            for i in (i for i, d in enumerate(decoding) if d):
                feeds[i] = feeds[i] + [PAD_TOKEN] * (width - len(feeds[i]))
                logit_rows[i] = width
        batch = StepBatch(
            [item.seq.seq_id for item in plan.items], feeds, [item.seq.num_cached for item in plan.items], logit_rows
        )
        out = self.runner.forward(batch, taps=plan.taps)
        logits = out.flat_logits
        if width is not None:  # the rows verification reads: each request's first 1 + k of its logit rows
            starts = list(itertools.accumulate(logit_rows, initial=0))[:-1]
            keep = [start + r for start, n in zip(starts, rows, strict=True) for r in range(n)]
            logits = logits.index_select(0, torch.tensor(keep, device=logits.device))
        sampling = [i for i, item in enumerate(plan.items) if item.samples]
        verdicts = verify_batch(
            logits,
            [drafts[i].tokens for i in sampling],
            [drafts[i].probs for i in sampling],
            [plan.items[i].seq.sampling for i in sampling],
            [plan.items[i].seq.generator for i in sampling],
        )
        outcomes: list[Outcome | None] = [None] * len(plan.items)
        kept = [len(item.feed) for item in plan.items]  # rows of positions the cache keeps
        for i, (accepted, emitted) in zip(sampling, verdicts, strict=True):
            outcomes[i] = Outcome(len(drafts[i].tokens), accepted, emitted)
            kept[i] += accepted
        hidden = [{layer: h[:n] for layer, h in taps.items()} for taps, n in zip(out.hidden, kept, strict=True)]
        t2 = time.perf_counter()
        decode_rows = sum(batch.logit_rows) if all(decoding) else None
        return StepResult(outcomes, hidden, (t1 - t0) * 1e3, (t2 - t1) * 1e3, decode_rows)

    def _padded_width(self, plan: StepPlan, rows: list[int], decoding: list[bool]) -> int | None:
        """The width the runner wants the decoding requests (newest token + drafts) padded to, if their padding
        fits the KV pool; requests that feed a prompt chunk beside them keep their length."""
        widths = [n for n, d in zip(rows, decoding, strict=True) if d]
        width = self.runner.padded_width(widths) if widths else None
        if width is None or width == min(widths):  # nothing to pad (the runner wants no padding, or all are full)
            return None
        needs = {item.seq.seq_id: width if d else len(item.feed) for item, d in zip(plan.items, decoding, strict=True)}
        return width if self.runner.pool.can_append(needs) else None

    def draft(self, plan: StepPlan) -> list[Draft]:
        """Each drafter proposes once, for all of its requests that may draft this step."""
        drafts = [Draft([]) for _ in plan.items]
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(plan.items):
            if item.k > 0:
                groups.setdefault(item.seq.spec.drafter, []).append(i)
        for name, members in groups.items():
            proposed = self.drafters.get(name).propose(
                [plan.items[i].seq for i in members], [plan.items[i].k for i in members]
            )
            for i, draft in zip(members, proposed, strict=True):
                k = plan.items[i].k
                drafts[i] = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k])
        return drafts
