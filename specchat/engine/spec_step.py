"""One speculation step over the whole batch: draft -> one target forward -> verify, with one device sync.

Input is the scheduler's StepPlan: for each request the tokens it feeds (a prompt chunk, or its newest token)
and how many drafts it may propose (k). Each drafter proposes for all of its requests at once; the target then
runs once over every request's [fed tokens + drafts] (verification and plain decoding are the same forward,
k = 0 being plain), and `verify_batch` decides all requests' accepted drafts and recovered / bonus tokens with a
single copy to the host. Nothing here touches a request's state: `Scheduler.postprocess` applies the result.

A step ahead: where the runner returns before the device has run a step (CUDA graphs) and every request of a
step decodes plainly (k = 0, nothing tapped), the step's tokens are drawn on the device (`plain_tokens`) and the
next step is launched with them as its input before the host reads them back: the host then applies this step,
delivers its text and plans the next while the device runs it (`_Ahead`). The next `run` takes the result of
every request that its plan continues from where the step ahead left it (a request that ended meanwhile drops
its row); a request that the plan feeds otherwise (it drafts now, say) has that position taken back from the KV
pool and its generator rewound, and runs with the plan's other requests as if nothing ran ahead. A request at its last
token is left out of the step launched ahead (it ends), and prompts admitted meanwhile run before the step ahead's
output is read and join the next step launched ahead (`_join`). Drafting steps run ahead the same way
(`_verdicts_ahead`, docs/gpu.md). The tokens are the ones the same forward and draw give without the step ahead
(tests/engine/test_step_ahead.py).

Timing (what StepRecord carries): every request of the step waited for the whole step, so each one is charged
the step's drafting time (draft_ms) and its forward + verification time (verify_ms): the wall time between its
tokens. Both are measured once per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from specchat.engine.cuda_graph import GraphedFunction
from specchat.engine.drafters import Draft, Drafter, DrafterCache, NoDrafter
from specchat.engine.runner import ModelRunner, RowOf, Rows, StepBatch, StepOutput, TokenContext
from specchat.engine.sequence import Sequence
from specchat.engine.verify import greedy_verdicts, plain_tokens, verify_batch
from specchat.errors import KVCacheFullError
from specchat.kernels import cpu_ops, fused
from specchat.quant.fp4_linear import embedding_pointer

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
    ahead: bool = False  # whether the next step may be launched ahead (the scheduler has nobody to admit)
    gated_next: bool = False  # whether adaptive requests will not draft next step either (their batch's DraftGate)


@dataclass(slots=True)
class Outcome:
    """What the step gave one request that samples (terms as in engine.verify)."""

    drafted: int  # draft tokens proposed (may be fewer than the plan's k)
    accepted: int
    emitted: list[int]  # accepted drafts + the recovered or bonus token
    source: str = ""  # Draft.source of the drafts


@dataclass(slots=True)
class StepResult:
    outcomes: list[Outcome | None]  # per plan item; None for a prompt chunk that samples nothing
    # per plan item: {tap layer: [rows, d]} for the positions the step processed and kept (a chunk's every
    # token; the fed tokens up to the last accepted draft otherwise); empty when no drafter taps
    hidden: list[dict[int, torch.Tensor]]
    draft_ms: float
    verify_ms: float
    decode_rows: int | None = None  # rows the target verified in a step of decoding only (padding included)
    decoding: bool = False  # every request of the step decoded (no prompt chunk)
    # requests whose next step is in flight: {seq_id: positions past num_cached the pool holds for it (its fed
    # tokens: 1 for a plain step, 1 + k for a drafting one)}
    ahead: dict[int, int] = field(default_factory=dict)


class _Tokens:
    """A step's tokens on the device, and on their way to the host: copied into pinned memory right after they are
    drawn, so that reading them waits for this step only. (`tolist()` on the device tensor would wait for every
    launch before it in the stream, the step launched ahead included, and nothing would overlap.)"""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.device = tokens
        self.done: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = tokens

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def rows(self, index: list[int]) -> torch.Tensor:
        """The tokens of these rows, on the device."""
        return _picked(self.device, index)


def _picked(rows: torch.Tensor, index: list[int]) -> torch.Tensor:
    """These rows of a device tensor (all of them: as it is), gathered without an index tensor from the host: a copy
    from pageable memory would wait for the stream."""
    if index == list(range(len(rows))):
        return rows
    return torch.stack([rows[r] for r in index]) if index else rows[:0]


@dataclass(slots=True)
class _Ahead:
    """A plain decode step launched before the host read the tokens it feeds."""

    seqs: list[Sequence]
    starts: list[int]  # each request's position fed (its num_cached when the step runs)
    tokens: _Tokens  # [n] the tokens it draws
    states: list[torch.Tensor | None]  # each request's generator state before the step's draw

    def take_back(self, pool, used: set[int]) -> None:
        """Undo the step for its requests (rows) not in `used` that still run: the KV position it reserved, the
        draw it made from their generators."""
        for row, (seq, start, state) in enumerate(zip(self.seqs, self.starts, self.states, strict=True)):
            if row in used or seq.finished:
                continue
            if pool.lengths.get(seq.seq_id) == start + 1:  # (a request preempted meanwhile has no pages left)
                pool.truncate(seq.seq_id, start)
            if state is not None:
                seq.generator.set_state(state)

    def rows(self, plan: StepPlan) -> dict[int, int]:
        """{plan item: row of this step} for the items it ran: a request decoding from the same position, no drafts.
        None of them where the plan taps hidden states: the step ran without (it was launched while the gate held drafting
        off, and this is the step before a trial, whose first drafting step drafts from the rows tapped now)."""
        if plan.taps:
            return {}
        where = {seq.seq_id: row for row, seq in enumerate(self.seqs)}
        rows = {}
        for i, item in enumerate(plan.items):
            row = where.get(item.seq.seq_id)
            if row is not None and item.k == 0 and len(item.feed) == 1 and item.seq.num_cached == self.starts[row]:
                rows[i] = row
        return rows


@dataclass(slots=True)
class _DraftAhead:
    """A drafting step launched before the host read the verdicts of the drafting step before it (greedy requests
    whose drafter drafts on the device): each request feeds its bonus or recovered token and k drafts, from
    wherever the step before left it."""

    seqs: list[Sequence]
    k: int
    out: StepOutput  # the step's target forward, in flight
    feeds: list[list[int]]  # each request's fed tokens (read back with the step before's verdicts)
    starts: list[int]  # each request's first fed position (known once those verdicts are read)
    sources: list[str] = field(default_factory=list)  # each request's drafts' Draft.source (read back with them)

    def rows(self, plan: StepPlan) -> dict[int, int]:
        """{plan item: row of this step} for the items it ran as the plan would but for k: each decoding from the
        position and token the step fed, drafting (its verdicts hold for any k), or at its last token (no room for
        drafts: the plan's k = 0; its verdict is cut to its room, the token plain decoding gives)."""
        where = {seq.seq_id: row for row, seq in enumerate(self.seqs)}
        rows = {}
        for i, item in enumerate(plan.items):
            row = where.get(item.seq.seq_id)
            if row is None or (item.k == 0 and item.seq.draft_room > 0) or item.seq.num_cached != self.starts[row]:
                continue
            if item.feed == self.feeds[row][:1]:
                rows[i] = row
        return rows

    def take_back(self, pool, used: set[int]) -> None:
        """Undo the step for its requests (rows) not in `used` that still run: the positions it reserved."""
        for row, (seq, start) in enumerate(zip(self.seqs, self.starts, strict=True)):
            held = pool.lengths.get(seq.seq_id)  # (a request preempted meanwhile has no pages left)
            if row not in used and not seq.finished and held is not None and held > start:
                pool.truncate(seq.seq_id, start)

    def output(self, index: list[int], apart: bool = False) -> StepOutput:
        """The step's output for these rows (all of them: as it is, or with `apart` its logits copied out of the
        graph's static buffer: another replay of the runner's graphs is to run before they are read, and the graphs
        share one memory pool, so a graph captured before this one may overwrite them; its hidden rows and fed ids
        are not in that pool; some of them: copies, whatever `apart` says)."""
        out = self.out
        if index == list(range(len(self.seqs))):
            if not apart:
                return out
            logits = out.flat_logits.clone()
            sizes = [len(logits) // len(index)] * len(index)
            return dataclasses.replace(out, flat_logits=logits, logits=Rows(logits, sizes), source=None)
        assert out.ids is not None and out.flat_hidden is not None
        n, q = len(self.seqs), len(out.ids) // len(self.seqs)

        def rows(flat: torch.Tensor) -> torch.Tensor:  # the picked requests' q rows each, one after another
            return _picked(flat.view(n, q, *flat.shape[1:]), index).flatten(0, 1)

        logits, hidden = rows(out.flat_logits), {layer: rows(h) for layer, h in out.flat_hidden.items()}
        sizes = [q] * len(index)
        return StepOutput(
            logits, Rows(logits, sizes), Rows(hidden, sizes), rows(out.ids), hidden, context=_context_rows(out, index)
        )


def _context_rows(out: StepOutput, index: list[int]) -> Callable[[], TokenContext] | None:
    """Where these requests (rows of the step `out`) have their tokens: the step's `TokenContext` cut to them (a
    graph's is as wide as its batch bucket, padding included)."""
    if out.context is None:
        return None
    whole = out.context

    def context() -> TokenContext:
        c = whole()
        return dataclasses.replace(c, tables=_picked(c.tables, index), positions=_picked(c.positions, index))

    return context


def _at_newest(context: TokenContext | None, accepted: torch.Tensor) -> TokenContext | None:
    """A drafting step's token context (positions: each request's first fed) moved to each request's newest token,
    after its accepted drafts."""
    return None if context is None else dataclasses.replace(context, positions=context.positions + accepted + 1)


def _batch_ahead(seqs: list[Sequence], q: int) -> StepBatch:
    """The step launched ahead for these requests (each feeding its newest token now, or a prompt joining) as the
    host stages it: q tokens each from the position after its newest, their ids on the device (the step before's
    tokens, `_launch_ahead`), and after a drafting step as if it accepted no draft (`forward_advanced` moves each by
    what it did)."""
    seq_ids = [seq.seq_id for seq in seqs]
    starts = [seq.num_tokens for seq in seqs]  # (num_cached + 1: each decodes its newest token)
    return StepBatch(seq_ids, [[PAD_TOKEN] * q] * len(seq_ids), starts, [q] * len(seq_ids))


def _going_on(plan: StepPlan) -> list[int]:
    """The items of a decoding step that may go on after it: all but those at their last token (no room for
    another: they end with this step, and a step launched ahead leaves them out)."""
    return [i for i, item in enumerate(plan.items) if item.seq.draft_room > 0]


@dataclass(slots=True)
class _Joining:
    """Prompts admitted beside a step that ran ahead (`SpecStep._join`): their forward launched before the host
    reads that step's tokens or verdicts, their first tokens drawn on the device, so that the next step, launched
    ahead, can take them beside the others instead of every request waiting for a step run on the host."""

    items: list[Scheduled]
    out: StepOutput  # their forward
    tokens: _Tokens  # [m] each one's first token
    # for greedy requests whose drafter drafts on the device: [m, q] what each feeds the next drafting step (its
    # first token and k drafts), and on their way to the host, with the drafts' source (`_first_drafts`)
    fed: torch.Tensor | None = None
    drafts: _Tokens | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.items]

    def result(self, read) -> StepResult:
        """What the step gave them (`read`: SpecStep._read): each one's first token, its rows tapped."""
        outcomes: list[Outcome | None] = [Outcome(0, 0, [token]) for token in read(self.tokens)]
        hidden = [{layer: h[: len(item.feed)] for layer, h in taps.items()}
                  for taps, item in zip(self.out.hidden, self.items, strict=True)]  # fmt: skip
        return StepResult(outcomes, hidden, 0.0, 0.0)


@dataclass(slots=True)
class _Following:
    """The drafting step to launch after a drafting step (`SpecStep._drafts_ahead`): its drafter, the items of the
    step before that it continues (`_going_on`), the prompts that join it (if any) and its batch as the host stages
    it (`_batch_ahead`)."""

    drafter: Drafter
    going_on: list[int]
    joining: _Joining | None
    batch: StepBatch


class SpecStep:
    """Drafts, runs the target and verifies, for every request of a plan at once."""

    def __init__(self, runner: ModelRunner, drafters: DrafterCache, ahead: bool | None = None) -> None:
        self.runner = runner
        self.drafters = drafters
        # run plain steps ahead (default: where the runner overlaps the host's work with the device's)
        self.runs_ahead = runner.overlaps if ahead is None else ahead
        # a drafting step's verdicts and the next step's drafts, one CUDA graph per batch bucket, drafter and k
        self._verdicts = GraphedFunction(
            self._verdicts_and_drafts,
            # (read every step: iterating parameters() cost ~6% of it; a tied MXFP4 embedding's `weight` would dequantize
            # the whole table at each read, at a new address: every step's graph captured anew)
            lambda: embedding_pointer(runner.model.embed),
            enabled=runner.overlaps,
        )
        self._ahead: _Ahead | _DraftAhead | None = None
        # Prompts admitted beside a *drafting* step ahead join the next one (`_join`, `_first_drafts`); off with
        # `SPECCHAT_JOINS_DRAFTING=0` (then they run after it and the step after them is not launched ahead; beside a
        # plain step ahead they join either way). It was off in the twenty-ninth session: on the H200 under load
        # (`benchmarks/spec_gpu.sh joins`: 8 sessions, 128 requests of repeated prompts) the process ended with an
        # illegal memory access. The prompts' forward replayed graphs before the step ahead's outputs were read, and
        # the graphs share one memory pool, so a graph captured earlier may write over a later one's outputs: the
        # step's logits are now copied out first (`_continue`), a NaN logit is never the heads' fused argmax, and a
        # graph's token context is cut to the step's rows (`_context_rows`). Since, the same load runs clean, and at
        # k = 4 joins took heads from 1.140x to 1.256x plain, ngram+heads from 1.297x to 1.352x (docs/benchmarks.md,
        # thirtieth session).
        self.joins_drafting = os.environ.get("SPECCHAT_JOINS_DRAFTING", "1") == "1"
        self.continued = 0  # steps whose result a step ahead had computed (counted for tests and profiles)
        self.drafted_ahead = 0  # of them, drafting steps
        self.waited_s = 0.0  # time plain steps spent waiting to read their tokens back (profiles: the device's lead)

    def warm_up(self, sessions: int, drafters: Iterable[str], max_k: int) -> None:
        """Capture the graphs of drafting ahead (verdicts and next drafts) for every batch bucket up to `sessions`'
        and each k up to max_k that each of `drafters` drafts on the device, so that a server's first requests
        capture none (a capture stalls the steps launched ahead: each is the function run twice, then recorded)."""
        if not self._verdicts.enabled:
            return
        model = self.runner.model
        d, dtype, device = model.cfg.hidden_size, model.embed.weight.dtype, self.runner.device
        for name in drafters:
            drafter = self.drafters.get(name)
            for k in range(1, max_k + 1):
                if not drafter.drafts_on_device(k):
                    break
                ids = torch.zeros(1, k + 1, dtype=torch.long, device=device)
                hidden = [torch.zeros(1, k + 1, d, dtype=dtype, device=device) for _ in drafter.taps]
                key = (name, id(drafter), k)
                # (one that reads the context: its chain, the lookup run apart where the step was no bound replay)
                self._verdicts.warm_up(sessions, [key], lambda key, i=ids, h=hidden: (i, i, *h))
                if sessions > 1 and self.joins_drafting:  # and the drafts of prompts joining a step ahead
                    # (`_first_drafts`), from one row each (a lone session has no step ahead to join)
                    first = (ids[:, :1], ids[:, :1], *(h[:, :1] for h in hidden))
                    self._verdicts.warm_up(sessions, [(*key, "first")], lambda key, f=first: f)
                self.runner.bind_after(k + 1, drafter.taps, key, self._verdicts_of_forward, self._verdicts.signature())

    def run(self, plan: StepPlan) -> StepResult:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            rows = ahead.rows(plan)
            ahead.take_back(self.runner.pool, set(rows.values()))
            if rows:
                return self._continue(plan, ahead, rows)
        return self._run(plan)

    def invalidate(self) -> None:
        """The weights or the KV format switched: forget the step ahead and every graph that baked in the old ones
        (explicitly: a signature of module ids or pointers may meet the new modules at the old addresses)."""
        self.drop_ahead()
        self._verdicts.reset()
        self.runner.invalidate()

    def drop_ahead(self) -> None:
        """Forget a step launched ahead (before the engine changes weights, KV format or drafters under it)."""
        if self._ahead is not None:
            self._ahead.take_back(self.runner.pool, set())
        self._ahead = None

    def _continue(self, plan: StepPlan, ahead: _Ahead | _DraftAhead, rows: dict[int, int]) -> StepResult:
        """The step whose requests (those in `rows`) ran ahead: launch the next one, then read the verdicts or
        tokens. The plan's other requests: prompts admitted meanwhile run first and join the next step where it may
        take them (`_join`); any other (one whose step ahead was taken back) runs after, and then nothing runs
        ahead."""
        t0 = time.perf_counter()
        self.continued += 1
        covered = StepPlan([plan.items[i] for i in rows], plan.taps, plan.ahead, plan.gated_next)
        index = list(rows.values())
        rest = [i for i in range(len(plan.items)) if i not in rows]
        left = [plan.items[i] for i in rest]
        joins = bool(rest) and self._joins(plan, left, ahead)
        # (a drafting step's output taken before prompts joining it replay graphs that may overwrite it)
        out = ahead.output(index, apart=joins) if isinstance(ahead, _DraftAhead) else None
        joining = self._join(plan, left, ahead) if joins else None
        ahead_next = not rest or joining is not None  # whether the next step may be launched ahead
        if isinstance(ahead, _DraftAhead):
            assert out is not None
            self.drafted_ahead += 1
            following = self._drafts_ahead(covered, ahead.k, joining) if ahead_next else None
            sources = [ahead.sources[r] for r in index]
            result = self._verdicts_ahead(covered, out, ahead.k, sources, following, t0, t0)
        else:
            launched = self._launch_ahead(covered, ahead.tokens.rows(index), joining) if ahead_next else None
            drawn = self._read(ahead.tokens)
            # no decode_rows: the time from here is not what one step costs (StepCosts would learn it as such)
            outcomes = [Outcome(0, 0, [drawn[r]]) for r in index]
            result = self._hold(launched, StepResult(outcomes, [{} for _ in index], 0.0, 0.0, decoding=True))
            result.verify_ms = (time.perf_counter() - t0) * 1e3
        if not rest:
            return result
        full: list[Outcome | None] = [None] * len(plan.items)
        hidden: list[dict[int, torch.Tensor]] = [{} for _ in plan.items]
        for j, i in enumerate(rows):
            full[i], hidden[i] = result.outcomes[j], result.hidden[j]
        others = joining.result(self._read) if joining else self._run(StepPlan(left, plan.taps))
        for j, i in enumerate(rest):
            full[i], hidden[i] = others.outcomes[j], others.hidden[j]
        return StepResult(
            full, hidden, others.draft_ms + result.draft_ms, others.verify_ms + result.verify_ms,
            decoding=others.decoding, ahead=result.ahead,
        )  # fmt: skip

    def _joins(self, plan: StepPlan, items: list[Scheduled], ahead: _Ahead | _DraftAhead) -> bool:
        """Whether the plan's requests that the step ahead did not run (`items`) join the next step (`_join`): each
        is a prompt (or its last chunk) that draws its first token now. Not where one is a request whose step ahead
        was taken back, nor beside a drafting step ahead while `joins_drafting` is off (__init__ says when): they
        then run after the others, as any step."""
        if not (self.runs_ahead and plan.ahead) or (isinstance(ahead, _DraftAhead) and not self.joins_drafting):
            return False
        # (not a prompt: a decoding request, k = 0, whose step ahead was taken back)
        return not any(not item.samples or item.k or (len(item.feed) == 1 and item.seq.output_ids) for item in items)

    def _join(self, plan: StepPlan, items: list[Scheduled], ahead: _Ahead | _DraftAhead) -> _Joining:
        """Run now the prompts admitted beside a step that ran ahead (`items`, where `_joins`), before the host reads
        that step's output: the tokens drawn on the device (`plain_tokens`, what verification draws at k = 0) and,
        after a step of drafting, each greedy one's drafts after its token (`_first_drafts`), so that the next step
        may be launched ahead with them too (`_launch_ahead`, `_drafts_ahead`). (Measured on the H200 at 8
        sessions: each request admitted meanwhile cost a step that fed its prompt and could not overlap the host,
        then a step that could not run ahead, ~4.5 ms where two steps of drafting ahead took 2.2.)"""
        seqs = [item.seq for item in items]
        feeds, starts = [item.feed for item in items], [seq.num_cached for seq in seqs]
        out = self.runner.forward(StepBatch([s.seq_id for s in seqs], feeds, starts, [1] * len(items)), plan.taps)
        tokens = plain_tokens(out.flat_logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        joining = _Joining(items, out, _Tokens(tokens))
        if isinstance(ahead, _DraftAhead) and all(seq.sampling.greedy for seq in seqs):
            self._first_drafts(joining, ahead.seqs[0].spec.drafter, ahead.k)
        return joining

    def _first_drafts(self, joining: _Joining, name: str, k: int) -> None:
        """Each joining prompt's k drafts after its first token, drafted on the device from its last tapped row by
        drafter `name` (`_verdicts_and_drafts` over one row each: nothing to verify; one CUDA graph per batch bucket
        and k), for the next drafting step; nothing where that drafter does not draft k on the device or a row was
        not tapped. A drafter that reads the requests' tokens (the hybrid's lookup) drafts its chain alone here: run
        eagerly over each prompt's pages, the lookup cost a joining step ~1.9 ms more than the heads' on the H200,
        and compiled anew for page tables of new widths."""
        drafter = self.drafters.get(name)
        hidden = joining.out.hidden
        if not drafter.drafts_on_device(k) or any(tap not in rows for rows in hidden for tap in drafter.taps):
            return
        first = joining.tokens.device[:, None]
        rows = [torch.stack([h[tap][-1] for h in hidden])[:, None] for tap in drafter.taps]
        packed, *_ = self._verdicts((name, id(drafter), k, "first"), first, first, *rows)
        joining.fed = packed[:, 2 : 3 + k]  # [accepted (0), target, its first token, k drafts, their source]
        joining.drafts = _Tokens(packed)

    def _read(self, tokens: _Tokens) -> list[int]:
        t = time.perf_counter()
        host = tokens.read()
        self.waited_s += time.perf_counter() - t
        return host

    def _launch_ahead(self, plan: StepPlan, tokens: torch.Tensor, joining: _Joining | None = None) -> _Ahead | None:
        """Launch the step after `plan` (a plain decode step whose tokens are `tokens`, on the device) if every
        request that goes on after it (`_going_on`: one at its last token is left out), and every prompt joining it,
        will decode plainly, room allowing; None otherwise."""
        if not (self.runs_ahead and plan.ahead and not plan.taps):
            return None
        going_on = _going_on(plan)
        seqs = [plan.items[i].seq for i in going_on] + (joining.seqs if joining else [])
        if not seqs or any(self._drafts_next(seq, plan) for seq in seqs):  # (the next step decodes plainly too)
            return None
        if joining is not None and any(seq.draft_room <= 0 for seq in joining.seqs):
            return None  # (a prompt at its last token ends with its first)
        tokens = _picked(tokens, going_on)
        if joining is not None:
            tokens = torch.cat([tokens, joining.tokens.device])
        batch = _batch_ahead(seqs, 1)
        if not self.runner.pool.can_append(dict.fromkeys(batch.seq_ids, 2)) or not self.runner.can_run_ahead(batch):
            return None
        states = [None if seq.generator is None else seq.generator.get_state() for seq in seqs]
        out = self.runner.forward(batch, ids=tokens)
        drawn = plain_tokens(out.flat_logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        return _Ahead(seqs, batch.start_positions, _Tokens(drawn), states)

    def _drafts_next(self, seq: Sequence, plan: StepPlan) -> bool:
        """Whether the request may draft at the step after `plan`: it has a drafter and a fixed k > 0, or an
        adaptive k that its batch's gate does not keep at 0 (a gate's trial is taken back when it comes)."""
        if isinstance(self.drafters.get(seq.spec.drafter), NoDrafter):
            return False
        return not plan.gated_next if seq.adaptive is not None else seq.k > 0

    def _run(self, plan: StepPlan) -> StepResult:
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
        if width is None and all(decoding) and all(n == 1 for n in rows):
            return self._plain(plan, out, t0, t1)
        # every request drafted k (one at its last token drafts none, padded to the others' width)
        k = max(len(d.tokens) for d in drafts)
        full = all(len(d.tokens) == k or item.seq.draft_room <= 0 for d, item in zip(drafts, plan.items, strict=True))
        if out.ids is not None and full and all(n == k + 1 for n in logit_rows):
            following = self._drafts_ahead(plan, k)
            if following is not None:
                return self._verdicts_ahead(plan, out, k, [d.source for d in drafts], following, t0, t1)
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
            outcomes[i] = Outcome(len(drafts[i].tokens), accepted, emitted, drafts[i].source)
            kept[i] += accepted
        hidden = [{layer: h[:n] for layer, h in taps.items()} for taps, n in zip(out.hidden, kept, strict=True)]
        t2 = time.perf_counter()
        decode_rows = sum(batch.logit_rows) if all(decoding) else None
        return StepResult(outcomes, hidden, (t1 - t0) * 1e3, (t2 - t1) * 1e3, decode_rows, decoding=all(decoding))

    def _plain(self, plan: StepPlan, out: StepOutput, t0: float, t1: float) -> StepResult:
        """A step of plain decoding (no drafts): its tokens drawn on the device, the next step launched ahead of
        reading them where it may be."""
        seqs = [item.seq for item in plan.items]
        tokens = _Tokens(plain_tokens(out.flat_logits, [s.sampling for s in seqs], [s.generator for s in seqs]))
        launched = self._launch_ahead(plan, tokens.device)
        host = self._read(tokens)
        outcomes: list[Outcome | None] = [Outcome(0, 0, [token]) for token in host]
        hidden = [{layer: h[:1] for layer, h in taps.items()} for taps in out.hidden]
        rows = None if launched is not None else len(seqs)  # a step that launched the next is not one step's cost
        result = StepResult(outcomes, hidden, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, rows, decoding=True)
        return self._hold(launched, result)

    def _hold(self, launched: _Ahead | _DraftAhead | None, result: StepResult) -> StepResult:
        """Keep the step launched ahead (if any) for the next run; the result says whose pool holds its positions."""
        if launched is not None:
            self._ahead = launched
            held = 1 + launched.k if isinstance(launched, _DraftAhead) else 1
            result.ahead = dict.fromkeys((seq.seq_id for seq in launched.seqs), held)
        return result

    def _drafts_ahead(self, plan: StepPlan, k: int, joining: _Joining | None = None) -> _Following | None:
        """The step after `plan` (a drafting step, k drafts each), if it may be launched before the host reads this
        one's verdicts: every request greedy, decoding with the same drafter, which drafts on the device
        (`Drafter.draft_on_device`), and each one that goes on (`_going_on`) drafting again next step with room in
        its context for k more drafts; None otherwise (this step is then verified as any other). A request near its
        max tokens does not hold the others back: the step drafts k for it too, and its verdicts are cut to its room
        (`_verdicts_ahead`), where it ends; one at its last token is left out of the step ahead. (Measured on the
        H200, 8 sessions: such a request's last step ran apart from the step ahead and launched none, so each
        request's end cost the batch about three steps that could not run ahead.) Prompts joining (`_join`) draft
        from their first token, greedy requests of the same drafter with room for a drafting step."""
        if not (self.runs_ahead and plan.ahead and k > 0) or plan.gated_next:
            return None
        names = {item.seq.spec.drafter for item in plan.items}
        if len(names) != 1:
            return None
        name = names.pop()
        drafter = self.drafters.get(name)
        if not drafter.drafts_on_device(k):
            return None
        q = k + 1
        if not all(item.samples and len(item.feed) == 1 and item.seq.sampling.greedy for item in plan.items):
            return None
        going_on = _going_on(plan)
        joiners = joining.seqs if joining else []
        if joining is not None and (joining.fed is None or len(joining.fed[0]) != q):
            return None  # (drafts are made for joining prompts only where all are greedy: `_join`)
        if any(seq.spec.drafter != name or seq.draft_room <= 0 for seq in joiners):
            return None
        seqs = [plan.items[i].seq for i in going_on] + joiners
        # each drafts again next step: after this step up to q more tokens, then the next step's q positions
        if not seqs or any(not self._drafts_next(s, plan) or s.num_tokens + 2 * q > s.max_position for s in seqs):
            return None
        batch = _batch_ahead(seqs, q)
        if not self.runner.pool.can_append(dict.fromkeys(batch.seq_ids, q)):
            return None
        if not self.runner.can_run_ahead(batch, plan.taps, advanced=True):
            return None
        return _Following(drafter, going_on, joining, batch)

    def _verdicts_ahead(
        self,
        plan: StepPlan,
        out: StepOutput,
        k: int,
        sources: list[str],
        following: _Following | None,
        t0: float,
        t1: float,
    ) -> StepResult:
        """A drafting step of greedy requests (`out`: its target forward, each request's newest token and k
        drafts) verified on the device (`greedy_verdicts`), and where `_drafts_ahead` allows, the next drafting
        step launched before the host reads the verdicts: its drafts drafted on the device from the hidden rows at
        each request's last accepted position and its bonus or recovered token, its start moved on the device.
        sources: each request's drafts' Draft.source; following: `_drafts_ahead(plan, k)`, None to launch nothing."""
        q, n = k + 1, len(plan.items)
        assert out.ids is not None

        def targets() -> tuple[torch.Tensor, torch.Tensor]:  # each request's argmax rows and fed tokens [n, q]
            return cpu_ops.argmax(out.flat_logits).view(n, q), out.ids.view(n, q)

        launched, kept_rows = None, None
        if following is None:
            target, fed = targets()
            verdicts = _Tokens(torch.cat([greedy_verdicts(target, fed)[:, None], target], 1))
        else:
            drafter = following.drafter
            key = (plan.items[0].seq.spec.drafter, id(drafter), k)
            # [n, 2 + 2q] verdicts, next drafts and their source; [n, d] each tap's row at the last accepted
            # position: one replay bound to the forward's outputs where it was one (graphs), else one GraphedFunction
            # call
            outs = self.runner.replay_after(out, key, self._verdicts_of_forward, self._verdicts.signature())
            if outs is None:
                assert out.flat_hidden is not None, "a drafting step ahead runs as one forward"
                hidden = [out.flat_hidden[layer].view(n, q, -1) for layer in drafter.taps]
                outs = self._verdicts(key, *targets(), *hidden)  # (without a context: a drafter's chain alone)
                where = _context_rows(out, list(range(n))) if drafter.reads_context else None
                if where is not None:  # the lookup apart: its inputs, the step's page tables, vary in width
                    outs = (self._looked_up(drafter, k, outs[0], where()), *outs[1:])
            packed, *rows = outs
            verdicts = _Tokens(packed)
            going_on = _picked(packed, following.going_on)
            advance = going_on[:, 0]
            fed_next = going_on[:, 1 + q : 1 + 2 * q]  # each one's bonus or recovered token and drafts
            seqs = [plan.items[i].seq for i in following.going_on]
            if following.joining is not None:  # prompts joining: their first token and drafts, from their start
                fed_next = torch.cat([fed_next, following.joining.fed])
                advance = torch.cat([advance, advance.new_zeros(len(following.joining.items))])
                seqs += following.joining.seqs
            forward = self.runner.forward_advanced(
                following.batch, fed_next.reshape(-1), advance.contiguous(), plan.taps
            )
            launched = _DraftAhead(seqs, k, forward, [], [])
            if not drafter.tap_history:  # what a request keeps is that row alone, sliced where read (copied: the
                # graph's next replay overwrites it)
                kept = {layer: r.clone() for layer, r in zip(drafter.taps, rows, strict=True)}
                kept_rows = [RowOf(kept, i) for i in range(n)]
        host = self._read(verdicts)
        outcomes: list[Outcome | None] = []
        for item, row, source in zip(plan.items, host, sources, strict=True):
            # the drafts that fit its max tokens count (what the scheduler would have let it draft): it ends here
            room = min(k, item.seq.draft_room)
            a = min(row[0], room)
            outcomes.append(Outcome(room, a, row[1 : a + 2], source))
        if launched is not None:  # what the next step feeds, from where the device moved each request
            names = ("", *following.drafter.sources)
            continued = [(plan.items[i], host[i]) for i in following.going_on]
            launched.feeds = [row[1 + q : 1 + 2 * q] for _, row in continued]
            launched.sources = [names[row[-1]] for _, row in continued]
            launched.starts = [item.seq.num_cached + row[0] + 1 for item, row in continued]
            if following.joining is not None:  # (each one's first token and drafts, at the prompt's end)
                assert following.joining.drafts is not None
                for seq, row in zip(following.joining.seqs, self._read(following.joining.drafts), strict=True):
                    launched.feeds.append(row[2 : 2 + q])
                    launched.sources.append(names[row[-1]])
                    launched.starts.append(seq.num_tokens)
        if kept_rows is None:  # the rows up to the last accepted draft (one that ends here may accept fewer)
            hidden_kept = [
                {layer: h[: o.accepted + 1] for layer, h in taps.items()}
                for taps, o in zip(out.hidden, outcomes, strict=True)
            ]
        else:  # a request's accepted count differs from the device's only where it ends here
            hidden_kept = kept_rows
        result = StepResult(outcomes, hidden_kept, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, decoding=True)
        return self._hold(launched, result)

    def _verdicts_of_forward(
        self,
        key: tuple,
        logits: torch.Tensor,
        ids: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        context: TokenContext,
    ) -> tuple[torch.Tensor, ...]:
        """`_verdicts_and_drafts` from a drafting step's forward as it left it: logits [B*q, vocab], fed ids [B*q],
        the tapped rows {layer: [B*q, d]}, where its requests' tokens are (runner.replay_after)."""
        q = key[2] + 1
        drafter = self.drafters.get(key[0])
        target = cpu_ops.argmax(logits).view(-1, q)
        rows = (hidden[t].unflatten(0, (-1, q)) for t in drafter.taps)
        return self._verdicts_and_drafts(key, target, ids.view(-1, q), *rows, context=context)

    def _verdicts_and_drafts(
        self,
        key: tuple,
        target: torch.Tensor,
        fed: torch.Tensor,
        *hidden: torch.Tensor,
        context: TokenContext | None = None,
    ):
        """(drafter name, its id, k[, a tag of the graph]), each request's argmax target [B, q] and fed tokens [B, q]
        at a drafting step's rows, the drafter's tapped rows [B, q, d] (one per tap) -> ([B, 2 + 2q]: the accepted
        count, the targets, the next step's fed tokens (the bonus or recovered token, then k drafts from the row at
        the last accepted position) and their source (0: the drafter's own, i: its i-th of `sources`); then that
        row [B, d] of each tap). context: where the step's requests' tokens are, for a drafter that `reads_context`
        (None: it drafts without). Device ops only: captured per batch bucket (`self._verdicts`, or bound to the
        step's graph)."""
        name, _, k = key[:3]
        drafter = self.drafters.get(name)
        if fused.verdicts_supported(target, fed):  # (one launch for the compare, the count and the indices)
            from specchat.kernels import verdicts_triton

            accepted, newest, flat = verdicts_triton.greedy_verdicts(target, fed)
            at_newest = [h.flatten(0, 1).index_select(0, flat) for h in hidden]
        else:
            accepted = greedy_verdicts(target, fed)
            rows = torch.arange(len(target), device=target.device)
            newest = target[rows, accepted]  # the bonus or recovered tokens
            at_newest = [h[rows, accepted] for h in hidden]
        context = _at_newest(context, accepted) if drafter.reads_context else None
        drafted = drafter.draft_on_device(k, dict(zip(drafter.taps, at_newest, strict=True)), newest, context)
        chain, source = drafted if isinstance(drafted, tuple) else (drafted, torch.zeros_like(newest))
        return (torch.cat([accepted[:, None], target, newest[:, None], chain, source[:, None]], 1), *at_newest)

    @staticmethod
    def _looked_up(drafter: Drafter, k: int, packed: torch.Tensor, context: TokenContext) -> torch.Tensor:
        """`_verdicts_and_drafts`' packed rows [B, 2 + 2q] of a drafter that `reads_context`, made without the
        context, with what its lookup there makes of their drafts (`Drafter.look_up`): the same rows as one call
        with the context."""
        q = k + 1
        accepted, newest = packed[:, 0], packed[:, 1 + q]
        chain, source = drafter.look_up(packed[:, 2 + q : 2 + q + k], newest, _at_newest(context, accepted))
        return torch.cat([packed[:, : 2 + q], chain, source[:, None]], 1)

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
            seqs = [plan.items[i].seq for i in members]
            try:
                proposed = self.drafters.get(name).propose(seqs, [plan.items[i].k for i in members])
            except KVCacheFullError:
                # the drafter's own KV pool is full (an EAGLE head's is sized from the target's capacity when it is
                # built, which a live switch to a smaller KV format raises): its requests verify no drafts this step
                # (plain decoding, not the batch's failure) and it forgets them, to take them up again from their
                # next rows
                for seq in seqs:
                    self.drafters.release(seq)
                continue
            for i, draft in zip(members, proposed, strict=True):
                k = plan.items[i].k
                drafts[i] = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], draft.source)
        return drafts
