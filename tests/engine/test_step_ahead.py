"""Plain decode steps launched ahead of the host (SpecStep's step ahead, on by default where CUDA graphs run):
the same tokens as steps run one after another, through requests ending, new requests arriving, drafting
switched on mid-run and seeded sampling; no KV page left behind.

On the CPU the runner's forward has finished when it returns, so nothing overlaps, but the bookkeeping is the
same code (turned on here with `runs_ahead`); tests/engine/test_cuda_graph.py runs it on graphs."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from specchat.config import SamplingParams, SpecParams
from specchat.engine.drafters import Draft, Drafter
from specchat.engine.sequence import Finished

PROMPTS = ["Hi", "def fib(n):", "List three colors.", "What is 12 * 12?", "Tell me a fact about the moon."]


def _run(engine, ahead: bool, jobs, late=(), at_step=3, stop_after=None, switch=None):
    """Submit `jobs` [(prompt, SamplingParams)], step the engine to the end (submitting `late` at step `at_step`,
    calling `switch(engine, handles)` there too), and return each request's tokens, how many steps ran ahead and
    the requests' Finished events.
    stop_after {job: n}: that request stops at its n-th token (it becomes its stop token)."""
    engine.spec_step.runs_ahead = ahead
    engine.spec_step.drop_ahead()
    continued = engine.spec_step.continued
    free = engine.pool.num_free_pages  # (pages the prefix cache keeps count as free)
    try:
        handles = [engine.submit(p, sp) for p, sp in jobs]
        for job, token in (stop_after or {}).items():
            seq = next(s for s in engine.scheduler.live() if s.seq_id == handles[job].request_id)
            seq.eos_ids = frozenset({token})
        finished: dict[int, Finished] = {}
        step = 0
        while engine.scheduler.has_work() or step <= at_step:
            step += 1
            if step == at_step:
                handles += [engine.submit(p, sp) for p, sp in late]
                if switch is not None:
                    switch(engine, handles)
            for event in engine.step():
                if isinstance(event, Finished):
                    finished[event.request_id] = event
        assert engine.pool.num_free_pages == free, "KV pages left behind"
        ends = [finished[h.request_id] for h in handles]
        return [end.token_ids for end in ends], engine.spec_step.continued - continued, ends
    finally:
        engine.spec_step.runs_ahead = engine.runner.overlaps
        engine.spec_step.drop_ahead()


def test_steps_ahead_give_the_tokens_of_steps_one_by_one(tiny_engine):
    greedy = [(p, SamplingParams(max_tokens=8 + 3 * i)) for i, p in enumerate(PROMPTS[:3])]
    sampled = [(PROMPTS[3], SamplingParams(temperature=0.8, seed=7, max_tokens=14))]
    late = [(PROMPTS[4], SamplingParams(max_tokens=9)), (PROMPTS[0], SamplingParams(temperature=1.0, seed=3))]
    plain, _, _ = _run(tiny_engine, False, greedy + sampled, late)
    # the second request stops at its fourth token: a step ahead was launched for it and is dropped
    stop = {1: plain[1][3]}
    plain, _, _ = _run(tiny_engine, False, greedy + sampled, late, stop_after=stop)
    ahead, continued, _ = _run(tiny_engine, True, greedy + sampled, late, stop_after=stop)
    assert ahead == plain
    assert len(plain[1]) == 3  # the stop token ended it
    assert continued > 10  # most steps ran ahead


def test_a_request_that_starts_drafting_takes_its_step_ahead_back(tiny_engine):
    """Mid-run, drafting (n-gram, k = 3) switched on for one request: the step that ran ahead for it is taken
    back (its KV position and its generator's draw) and it goes on drafting; every output equals plain decoding
    (greedy: lossless) or the same seeded run without steps ahead (sampled)."""
    jobs = [(PROMPTS[1], SamplingParams(max_tokens=20)), (PROMPTS[2], SamplingParams(temperature=0.8, seed=5))]

    def switch(engine, handles):
        engine.set_drafter("ngram", handles[0].request_id)
        engine.set_k(3, handles[0].request_id)

    plain, _, _ = _run(tiny_engine, False, jobs, switch=switch)
    ahead, continued, _ = _run(tiny_engine, True, jobs, switch=switch)
    assert ahead == plain
    assert continued > 0
    alone, _, _ = _run(tiny_engine, False, jobs[:1])
    assert ahead[0] == alone[0]


@pytest.mark.parametrize("ahead", [False, True])
def test_no_step_runs_ahead_of_a_request_at_its_last_token(tiny_engine, ahead):
    """max_tokens 1 and 2: the last step of a request launches nothing after it."""
    jobs = [(PROMPTS[0], SamplingParams(max_tokens=1)), (PROMPTS[1], SamplingParams(max_tokens=2))]
    tokens, continued, _ = _run(tiny_engine, ahead, jobs)
    assert [len(t) for t in tokens] == [1, 2]
    assert continued == 0


def test_adaptive_requests_that_their_gate_keeps_plain_run_ahead(tiny_engine):
    """Adaptive k (`--k auto`) where the batch's DraftGate prefers plain decoding: those steps run ahead too, the
    gate's trial of drafting (a drafter that always proposes) takes the step ahead back, and greedy output equals
    plain decoding."""
    from specchat.engine.adaptive import DraftGate
    from tests.engine.test_adaptive import FixedDrafter

    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()

    jobs = [(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in PROMPTS[:3]]
    plain, _, _ = _run(tiny_engine, False, jobs)
    tiny_engine.scheduler.gates.clear()
    # plain measured faster; a trial of drafting comes after ~16 steps
    tiny_engine.scheduler.gates[("fixed-wrong",), 4] = DraftGate(ms_per_token={True: 50.0, False: 1.0}, since_trial=240)
    original = tiny_engine.submit

    def adaptive_ngram(prompt, sampling, spec=None, **kw):
        return original(prompt, sampling, SpecParams(drafter="fixed-wrong", k=None), **kw)

    tiny_engine.submit = adaptive_ngram
    try:
        ahead, continued, ends = _run(tiny_engine, True, jobs)
    finally:
        tiny_engine.submit = original
        tiny_engine.scheduler.gates.clear()
    assert ahead == plain
    assert continued > 20
    assert any(end.stats.drafted for end in ends)  # the gate's trial drafted (its step ahead taken back)


class BigramDrafter(Drafter):
    """Drafts by a fixed table of next tokens (what followed each token in a plain run), on the host and on the
    device alike; with `taps` it asks for hidden rows, and checks that the device chain gets one per request."""

    name = "bigram"

    def __init__(self, table: torch.Tensor, taps: tuple[int, ...] = ()) -> None:
        self.table, self.taps = table, taps

    def propose(self, seqs, ks):
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            token, tokens = seq.newest, []
            for _ in range(k):
                token = int(self.table[token])
                tokens.append(token)
            drafts.append(Draft(tokens))
        return drafts

    def draft_on_device(self, depth, hidden, newest, context=None):
        assert set(hidden) == set(self.taps) and all(h.shape[0] == len(newest) for h in hidden.values())
        tokens, token = [], newest
        for _ in range(depth):
            token = self.table[token]
            tokens.append(token)
        return torch.stack(tokens, 1)


def _bigram(engine, outputs: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(engine.model.cfg.vocab_size, dtype=torch.long)
    for tokens in outputs:
        for a, b in itertools.pairwise(tokens):
            table[a] = b
    return table


def _drafting_both_ways(engine, name: str, drafter, k: int | None, jobs, *run_args, **run_kw):
    """`_run` with every request drafting with `drafter` (registered as `name`) at k, one by one and then with
    steps ahead -> (tokens one by one, their Finished events, tokens ahead, theirs, drafting steps run ahead)."""
    engine.drafters[name] = drafter
    original = engine.submit

    def submit(prompt, sampling, spec=None, **kw):
        return original(prompt, sampling, SpecParams(drafter=name, k=k), **kw)

    engine.submit = submit
    try:
        one_by_one, _, ends = _run(engine, False, jobs, *run_args, **run_kw)
        before = engine.spec_step.drafted_ahead
        ahead, _, ends_ahead = _run(engine, True, jobs, *run_args, **run_kw)
        return one_by_one, ends, ahead, ends_ahead, engine.spec_step.drafted_ahead - before
    finally:
        engine.submit = original


def _drafts(ends) -> list[tuple[int, int]]:
    return [(end.stats.drafted, end.stats.accepted) for end in ends]


@pytest.mark.parametrize(("k", "taps"), [(3, ()), (2, (1,)), (1, ())])
def test_drafting_steps_launched_ahead_give_plain_greedy_tokens(tiny_engine, k, taps):
    """Greedy requests whose drafter drafts on the device: each drafting step's next one is launched before the
    host reads its verdicts (start moved by what it accepted), through requests ending at a stop token, arriving
    late and running alone; the tokens are plain greedy decoding's and the drafts and acceptances those of the
    same run without steps ahead; no KV page left behind."""
    jobs = [(p, SamplingParams(max_tokens=48 + 6 * i)) for i, p in enumerate(PROMPTS[:3])]
    late = [(PROMPTS[4], SamplingParams(max_tokens=40))]
    plain, _, _ = _run(tiny_engine, False, jobs, late)
    stop = {1: plain[1][13]}
    plain, _, _ = _run(tiny_engine, False, jobs, late, stop_after=stop)
    drafter = BigramDrafter(_bigram(tiny_engine, plain), taps)
    one_by_one, ends, ahead, ends_ahead, drafted_ahead = _drafting_both_ways(
        tiny_engine, "bigram", drafter, k, jobs, late, stop_after=stop
    )
    assert ahead == one_by_one == plain
    assert _drafts(ends_ahead) == _drafts(ends)
    assert sum(e.stats.accepted for e in ends) > sum(e.stats.drafted for e in ends) / 2  # drafts mostly accepted
    assert drafted_ahead > 5


def test_heads_drafting_ahead_draft_what_they_draft_one_by_one(tiny_engine):
    """The heads' chain on the device, from the hidden row at each request's last accepted position, drafts what
    `propose` drafts from the rows the scheduler keeps: the same drafts and acceptances with steps ahead, through
    prompts that arrive mid-run (run after the step ahead, then drafting with the others)."""
    from specchat.engine.drafters.heads import HeadsDrafter
    from tests.engine.test_drafters import random_heads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=4), tiny_engine.model, cpu_blocks=False)
    jobs = [(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS[:2]]
    # two prompts arrive together mid-run, one of them sharing a cached prefix
    late = [(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in (PROMPTS[3], PROMPTS[0])]
    plain, _, _ = _run(tiny_engine, False, jobs, late, at_step=5)
    one_by_one, ends, ahead, ends_ahead, drafted_ahead = _drafting_both_ways(
        tiny_engine, "heads:random", heads, 4, jobs, late, at_step=5
    )
    assert ahead == one_by_one == plain
    assert _drafts(ends_ahead) == _drafts(ends)
    assert drafted_ahead > 3


class ShallowBigram(BigramDrafter):
    """BigramDrafter that drafts at most two tokens on the device (as two heads do) and any number on the host
    (as the hybrid's lookup does)."""

    def drafts_on_device(self, depth=None):
        return depth is None or depth <= 2

    def draft_on_device(self, depth, hidden, newest, context=None):
        return super().draft_on_device(depth, hidden, newest) if self.drafts_on_device(depth) else None


def _steps_continued(engine, monkeypatch, drafting: bool, jobs, *run_args, joins=True, **run_kw) -> list[bool]:
    """`_run` one step after another and with steps ahead, plain or drafting (BigramDrafter at k = 3, on the
    device), holding the two to the same tokens (and drafts and acceptances) -> for each step of the run with steps
    ahead, whether it continued a step launched ahead. joins: whether prompts may join a drafting step ahead
    (`SpecStep.joins_drafting`, on by default; `SPECCHAT_JOINS_DRAFTING=0` turns it off)."""
    monkeypatch.setattr(engine.spec_step, "joins_drafting", joins)
    plain, _, _ = _run(engine, False, jobs, *run_args, **run_kw)
    steps = []
    run = engine.spec_step.run

    def counted(plan):
        before = engine.spec_step.continued
        result = run(plan)
        if engine.spec_step.runs_ahead:
            steps.append(engine.spec_step.continued > before)
        return result

    monkeypatch.setattr(engine.spec_step, "run", counted)
    if drafting:
        one_by_one, ends, ahead, ends_ahead, _ = _drafting_both_ways(
            engine, "bigram", BigramDrafter(_bigram(engine, plain)), 3, jobs, *run_args, **run_kw
        )
        assert ahead == one_by_one == plain
        assert _drafts(ends_ahead) == _drafts(ends)
    else:
        ahead, _, _ = _run(engine, True, jobs, *run_args, **run_kw)
        assert ahead == plain
    return steps


@pytest.mark.parametrize("drafting", [False, True])
def test_a_request_at_its_last_token_leaves_the_step_ahead_to_the_others(tiny_engine, monkeypatch, drafting):
    """Requests that end on different steps (max tokens 9, 14 and 21), decoding plainly or drafting on the device:
    each one's last step (no room for drafts: its plan's k is 0) is continued from the step ahead and left out of
    the next one, so every step after the first decoding step runs ahead. (On the H200 each request's end broke
    the drafting pipeline for about three steps.)"""
    jobs = [(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS[:3], (9, 14, 21), strict=True)]
    steps = _steps_continued(tiny_engine, monkeypatch, drafting, jobs)
    assert steps[:2] == [False, False] and all(steps[2:])  # (the prompts' step, then the first decoding step)


# two requests running when prompts arrive beside their steps ahead
TWO_RUNNING = [(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS[:2], (16, 24), strict=True)]


def poison_earlier_outputs(engine, monkeypatch) -> None:
    """Each forward first overwrites the logits of the one before with NaN, as a CUDA graph's replay may overwrite
    those of a graph captured after it (the runner's graphs share one memory pool): whatever reads a step's logits
    must have read them before the next forward runs."""
    forward = engine.runner.forward
    last: list = []

    def poisoning(*args, **kwargs):
        if last:
            with torch.inference_mode():
                last[0].flat_logits.fill_(float("nan"))
        last[:] = [forward(*args, **kwargs)]
        return last[0]

    monkeypatch.setattr(engine.runner, "forward", poisoning)


@pytest.mark.parametrize("drafting", [False, True])
def test_prompts_admitted_beside_a_step_ahead_join_the_next_one(tiny_engine, monkeypatch, drafting):
    """Two prompts submitted mid-run (one fresh, one sharing the first request's prompt) while the others' steps
    run ahead: their forward runs before the step ahead's output is read, and their first tokens (and drafts) are
    drawn on the device, so the next step is launched ahead with them too; every step after the first decoding
    step runs ahead, and tokens, drafts and acceptances are those of the run one step after another, even where
    each forward spoils the logits of the one before (`poison_earlier_outputs`: a drafting step's logits are copied
    out before the prompts' forward; on the H200, read after it, they ended the process under load)."""
    poison_earlier_outputs(tiny_engine, monkeypatch)
    jobs = TWO_RUNNING
    late = [
        (PROMPTS[3], SamplingParams(max_tokens=12, ignore_eos=True)),
        (PROMPTS[0] + " Hello", SamplingParams(max_tokens=30, ignore_eos=True)),
    ]
    steps = _steps_continued(tiny_engine, monkeypatch, drafting, jobs, late, at_step=5)
    assert steps[:2] == [False, False] and all(steps[2:])


def test_prompts_beside_a_drafting_step_ahead_run_after_it_with_joins_off(tiny_engine, monkeypatch):
    """With `SpecStep.joins_drafting` off (`SPECCHAT_JOINS_DRAFTING=0`), prompts admitted beside a drafting step
    ahead run after it and the step after them is not launched ahead; tokens, drafts and acceptances are still
    those of the run one step after another, and the other steps run ahead."""
    jobs = TWO_RUNNING
    late = [(PROMPTS[3], SamplingParams(max_tokens=12, ignore_eos=True))]
    steps = _steps_continued(tiny_engine, monkeypatch, True, jobs, late, at_step=5, joins=False)
    # the one prompt's arrival costs a step or two not launched ahead (its own, and its first decoding step's)
    assert steps[:2] == [False, False] and 1 <= steps[2:].count(False) <= 2 and steps[-1]


@pytest.mark.parametrize("drafting", [False, True])
def test_a_prompt_joins_whatever_step_it_arrives_at(tiny_engine, monkeypatch, drafting):
    """A prompt submitted at each step of a lone request's run, its last one included (the step ahead then holds
    the joining prompt alone): the tokens, drafts and acceptances of the run one step after another."""
    for at_step in range(3, 10):
        jobs = [(PROMPTS[1], SamplingParams(max_tokens=7, ignore_eos=True))]
        late = [(PROMPTS[2], SamplingParams(max_tokens=6, ignore_eos=True))]
        with monkeypatch.context() as patch:
            _steps_continued(tiny_engine, patch, drafting, jobs, late, at_step=at_step)


def test_drafts_deeper_than_the_device_chain_are_not_drafted_ahead(tiny_engine):
    """A step wider than its drafter drafts on the device (`drafts_on_device(k)`, as the hybrid's lookup drafting
    8 beside four heads) is verified on the host and not followed ahead (on the H200 it was, and failed): the
    tokens stay plain greedy decoding's; at k = 2 the same drafter runs ahead."""
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.engine.drafters.hybrid import NgramThenHeads
    from tests.engine.test_drafters import random_heads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=2), tiny_engine.model, cpu_blocks=False)
    assert all(d.drafts_on_device(2) and not d.drafts_on_device(4) for d in (heads, NgramThenHeads(heads)))
    jobs = [(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS[:2]]
    plain, _, _ = _run(tiny_engine, False, jobs)
    drafter = ShallowBigram(_bigram(tiny_engine, plain))
    for k, runs_ahead in ((4, False), (2, True)):
        one_by_one, ends, ahead, ends_ahead, drafted_ahead = _drafting_both_ways(
            tiny_engine, "shallow", drafter, k, jobs
        )
        assert ahead == one_by_one == plain
        assert _drafts(ends_ahead) == _drafts(ends)
        assert (drafted_ahead > 0) == runs_ahead


@pytest.fixture
def repeating_tiny_model(tiny_engine):
    """tiny_engine's model with its output head made to repeat (`repeating`) on an untied copy of the weight, the
    original put back after the test. (Not monkeypatch: pytest 9 deletes on undo an attribute that is not in the
    object's __dict__, as a module's parameters are not, which took the head's weight from later tests.)"""
    head = tiny_engine.model.lm_head
    original = head.weight
    head.weight = torch.nn.Parameter(original.detach().clone(), requires_grad=False)
    repeating(tiny_engine.model)
    yield
    head.weight = original


@pytest.mark.usefixtures("repeating_tiny_model")
def test_ngram_then_heads_drafting_ahead_draft_what_they_draft_one_by_one(tiny_engine, monkeypatch):
    """The hybrid on the device: the prompt lookup over each request's tokens in the pool's pages (every forward
    writes them there: prompts, and the steps run ahead) where it matches, the heads' chain elsewhere, drafts what
    `propose` drafts on the host: the same drafts and acceptances with steps ahead, and each lookup reads the
    request's own tokens up to its newest."""
    from specchat.engine.drafters import hybrid
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.kernels.ngram import context_window
    from tests.engine.test_drafters import random_heads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=4), tiny_engine.model, cpu_blocks=False)
    windows, found = [], []  # each device lookup's view of its requests' tokens, and whether it matched
    lookup = hybrid.ngram_kernels.lookup

    def recording(ids, tables, positions, newest, page_size, *args):
        window = context_window(ids, tables, positions, newest, page_size, 256)
        windows.extend([t for t in row if t >= 0] for row in window.tolist())
        drafts, hits = lookup(ids, tables, positions, newest, page_size, *args)
        found.extend(hits.tolist())
        return drafts, hits

    monkeypatch.setattr(hybrid.ngram_kernels, "lookup", recording)
    sources = {False: Counter(), True: Counter()}  # each step's drafts' sources, with and without steps ahead
    run = tiny_engine.spec_step.run

    def counting(plan):
        result = run(plan)
        # (steps of a full k: near its max tokens a request drafting ahead drafts the step's k, cut to its room, where
        # on the host it drafts its room, and a lookup matching that few tokens may not match k; and not a request's
        # first decoding step: a prompt that joined a step ahead drafts it with the heads' chain alone)
        ahead = tiny_engine.spec_step.runs_ahead
        for item, o in zip(plan.items, result.outcomes, strict=True):
            if o and o.drafted == 4 and len(item.seq.output_ids) > 1:
                sources[ahead][o.source] += 1
        return result

    monkeypatch.setattr(tiny_engine.spec_step, "run", counting)
    jobs = [(p, SamplingParams(max_tokens=28, ignore_eos=True)) for p in PROMPTS[:3]]
    late = [(PROMPTS[3], SamplingParams(max_tokens=20, ignore_eos=True))]
    plain, _, _ = _run(tiny_engine, False, jobs, late, at_step=5)
    one_by_one, ends, ahead, ends_ahead, drafted_ahead = _drafting_both_ways(
        tiny_engine, "ngram+heads:random", hybrid.NgramThenHeads(heads), 4, jobs, late, at_step=5
    )
    assert ahead == one_by_one == plain
    assert _drafts(ends_ahead) == _drafts(ends)
    assert drafted_ahead > 3
    texts = [tiny_engine.encode_prompt(p) + out for (p, _), out in zip(jobs + late, plain, strict=True)]
    # (a request's last step drafts on the device from its verdict, which may accept drafts past its max tokens
    # before the host cuts it to its room: that lookup reads past its text, whose end it holds)
    assert windows and all(any(t[: len(w)] == w[: len(t)] for t in texts) for w in windows)
    assert any(found) and not all(found)  # both sources drafted on the device
    assert sources[True] == sources[False] and sources[True]["ngram"] > 0  # and each is told apart on the host


def repeating(model) -> None:
    """Make the tiny random model's output head (in place) its embedding plus 1.3x its own: greedy text then
    repeats its newest token for a while and moves to a new one now and then (a random model's text never
    repeats, so a lookup would never match)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(1.3).add_(model.embed.weight)


def test_heads_draft_on_the_host_from_the_rows_kept_of_a_dropped_step_ahead(tiny_engine, monkeypatch):
    """A step ahead dropped mid-run (as a live setting does): the next step drafts on the host (`propose`) from the
    row each request kept of the last drafting step run ahead (a `RowOf`, sliced where read), and drafts what the
    run without steps ahead drafts from the rows it kept."""
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.engine.runner import RowOf
    from tests.engine.test_drafters import random_heads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=4), tiny_engine.model, cpu_blocks=False)
    drafted: dict[tuple, list[int]] = {}  # (prompt, position) -> drafts, from the run one by one (it runs first)
    from_rows_ahead = []  # drafts on the host from a RowOf: (their drafts, the run one by one's there)
    propose = heads.propose

    def recording(seqs, ks):
        drafts = propose(seqs, ks)
        for seq, draft in zip(seqs, drafts, strict=True):
            key = (tuple(seq.prompt_ids), seq.num_tokens)
            if isinstance(seq.hidden, RowOf):
                from_rows_ahead.append((draft.tokens, drafted.get(key)))
            else:
                drafted.setdefault(key, draft.tokens)
        return drafts

    monkeypatch.setattr(heads, "propose", recording)
    jobs = [(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS[:3]]
    plain, _, _ = _run(tiny_engine, False, jobs)

    def drop(engine, handles):
        engine.spec_step.drop_ahead()

    one_by_one, ends, ahead, ends_ahead, _ = _drafting_both_ways(
        tiny_engine, "heads:random", heads, 4, jobs, at_step=8, switch=drop
    )
    assert ahead == one_by_one == plain
    assert _drafts(ends_ahead) == _drafts(ends)
    assert from_rows_ahead and all(mine == theirs for mine, theirs in from_rows_ahead)


def test_sampled_or_adaptive_requests_draft_as_before(tiny_engine):
    """A sampled request in the batch keeps every drafting step on the host (its verdicts draw from its
    generator); adaptive k launches ahead only while the next k is this step's; outputs as without steps ahead."""
    jobs = [(PROMPTS[1], SamplingParams(max_tokens=30)), (PROMPTS[2], SamplingParams(temperature=0.8, seed=5))]
    plain, _, _ = _run(tiny_engine, False, jobs)
    table = _bigram(tiny_engine, plain)
    for k, expect_ahead in ((3, False), (None, None)):
        one_by_one, _, ahead, _, drafted_ahead = _drafting_both_ways(
            tiny_engine, "bigram", BigramDrafter(table), k, jobs
        )
        assert ahead == one_by_one
        assert ahead[0] == plain[0]  # greedy: lossless
        if expect_ahead is False:
            assert drafted_ahead == 0


def test_a_trial_of_drafting_drafts_from_its_first_step(tiny_engine, monkeypatch):
    """A lone adaptive request on a padded runner (CUDA graphs' bookkeeping, steps ahead on), its gate holding
    drafting off: plain steps run ahead without taps; the step before a trial taps, so it is not taken from the
    step ahead (which has no rows) and the trial's first step drafts like the others.

    The gate's timings stay as set: this machine's real step times, observed between the step that peeks and the
    one that is allowed, could make drafting preferred without a trial (a step that then drafts nothing, as the
    rows it would draft from were not tapped: harmless, but not what is tested here, and it made the test
    depend on the machine's speed)."""
    from specchat.engine.adaptive import TRIAL_STEPS, DraftGate
    from specchat.engine.drafters.heads import HeadsDrafter
    from tests.engine.test_drafters import random_heads

    monkeypatch.setattr(DraftGate, "observe", lambda self, *args, **kwargs: None)

    tiny_engine.drafters["heads:trial"] = HeadsDrafter(
        random_heads(tiny_engine.model), tiny_engine.model, cpu_blocks=False
    )
    scheduler = tiny_engine.scheduler
    scheduler.gates[("heads:trial",), 1] = DraftGate(ms_per_token={0: 1.0, 1: 3.0}, since_trial=200)
    scheduler.uniform_widths, tiny_engine.spec_step.runs_ahead = True, True
    drafted = []
    original = tiny_engine.spec_step.run

    def run(plan):
        result = original(plan)
        if scheduler._gated is not None and scheduler._gated[2]:  # a step of the trial
            drafted.extend(o.drafted for o in result.outcomes if o is not None)
        return result

    tiny_engine.spec_step.run = run
    try:
        spec = SpecParams("heads:trial", k=None)
        tiny_engine.submit("Hi", SamplingParams(max_tokens=120, ignore_eos=True), spec).result()
    finally:
        del tiny_engine.spec_step.run
        scheduler.uniform_widths, tiny_engine.spec_step.runs_ahead = False, tiny_engine.runner.overlaps
        scheduler.gates.clear()
    assert len(drafted) >= TRIAL_STEPS and all(drafted), drafted


def wandering_gate(monkeypatch, seed: int, caps=(0, 1, 2, 4), change=0.15) -> None:
    """Every DraftGate allows a cap that wanders among `caps` (another with chance `change` a step; its peek says
    what the next step gets), as trials and changes of choice do over a long run; each request's own controller
    asks for its k_max throughout (its choices follow step times, which would make the run depend on the
    machine's speed)."""
    from specchat.engine.adaptive import AdaptiveK, DraftGate

    monkeypatch.setattr(AdaptiveK, "update", lambda self, *args, **kwargs: self.k_max)
    monkeypatch.setattr(AdaptiveK, "next_k", lambda self: self.k_max)

    rng = random.Random(seed)
    state = {"next": rng.choice(caps)}

    def allow(self):
        cap = state["next"]
        if rng.random() < change:
            state["next"] = rng.choice(caps)
        self.allowed[cap] = self.allowed.get(cap, 0) + 1
        return cap

    monkeypatch.setattr(DraftGate, "allow", allow)
    monkeypatch.setattr(DraftGate, "peek", lambda self: state["next"] > 0)


def adaptive_jobs(n: int, late: int) -> tuple[list, list]:
    """n requests of different lengths at once and `late` more arriving mid-run, prompts repeated (the prefix cache
    serves the repeats), each running past its end of text."""
    jobs = [(PROMPTS[i % 5], SamplingParams(max_tokens=10 + 7 * i, ignore_eos=True)) for i in range(n)]
    more = [(PROMPTS[(i + 2) % 5], SamplingParams(max_tokens=9 + 5 * i, ignore_eos=True)) for i in range(late)]
    return jobs, more


def run_adaptive(engine, name: str, jobs, late, **run_kw):
    """`_run` with steps ahead, every request drafting adaptively (k_max 4) with drafter `name` -> its tokens and
    the drafting steps run ahead."""
    original = engine.submit

    def submit(prompt, sampling, spec=None, **kw):
        return original(prompt, sampling, SpecParams(drafter=name, k=None, k_max=4), **kw)

    engine.submit = submit
    try:
        before = engine.spec_step.drafted_ahead
        tokens, _, _ = _run(engine, True, jobs, late, **run_kw)
        return tokens, engine.spec_step.drafted_ahead - before
    finally:
        engine.submit = original
        engine.scheduler.gates.clear()


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_drafting_ahead_through_the_gates_changes_of_cap(tiny_engine, monkeypatch, seed):
    """Adaptive requests on a padded runner's bookkeeping (every one drafts its gate's cap, room allowing), the cap
    changing between plain decoding and 1, 2 or 4 drafts over the run as trials and choices do, requests ending on
    scattered steps and arriving late: plain greedy tokens, and drafting steps run ahead between the changes."""
    wandering_gate(monkeypatch, seed)
    jobs, late = adaptive_jobs(12, 8)
    plain, _, _ = _run(tiny_engine, False, jobs, late)
    tiny_engine.drafters["bigram"] = BigramDrafter(_bigram(tiny_engine, plain))
    tiny_engine.scheduler.uniform_widths = True
    try:
        ahead, drafted_ahead = run_adaptive(tiny_engine, "bigram", jobs, late)
    finally:
        tiny_engine.scheduler.uniform_widths = False
    assert ahead == plain
    assert drafted_ahead > 5


def test_a_drafting_step_verified_off_its_graph_reads_the_token_context_of_its_own_rows():
    """A graph's token context is as wide as its batch bucket (padding rows after the step's); a drafting step
    ahead verified apart from its bound graph (prompts joining it, or only some of its rows still running) gives
    the lookup of a drafter that reads the context (the hybrid's) the rows it verifies, in their order (on the
    H200 the bucket-wide context failed with a size mismatch)."""
    from specchat.engine.runner import Rows, StepOutput, TokenContext
    from specchat.engine.spec_step import _context_rows, _DraftAhead

    seqs, q, bucket = 3, 2, 4  # three requests, k = 1, a graph of bucket 4
    ids = torch.arange(seqs * q)
    logits, hidden = torch.randn(seqs * q, 5), {1: torch.randn(seqs * q, 3)}
    context = TokenContext(torch.arange(50), torch.arange(bucket * 2, dtype=torch.int32).view(bucket, 2),
                           torch.tensor([10, 20, 30, 0]), 16)  # fmt: skip
    sizes = [q] * seqs
    out = StepOutput(logits, Rows(logits, sizes), Rows(hidden, sizes), ids, hidden, context=lambda: context)
    ahead = _DraftAhead([None] * seqs, q - 1, out, [], [])
    cut = [(index, ahead.output(index).context) for index in ([0, 1], [2, 0], [1])]  # rows of the step ahead
    cut.append(([0, 1, 2], _context_rows(out, [0, 1, 2])))  # all of them (`_verdicts_ahead`)
    for index, where in cut:
        assert where().positions.tolist() == [(i + 1) * 10 for i in index]
        assert torch.equal(where().tables, context.tables[index])
    # the logits of some rows are copies (prompts joining replay graphs that may overwrite the step's), of all of
    # them too where prompts join (`apart`)
    for index in ([0, 1], [1, 2], [0, 1, 2]):
        picked = ahead.output(index, apart=True).flat_logits
        assert picked.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
        assert torch.equal(picked, logits.view(seqs, q, -1)[index].flatten(0, 1))
    assert _context_rows(StepOutput(logits, Rows(logits, sizes), Rows(hidden, sizes)), [0]) is None


def test_the_hybrids_lookup_run_apart_from_its_chain_gives_the_rows_of_one_call(tiny_engine):
    """A drafting step verified off its bound graph (prompts joined it) runs the verdicts and the heads' chain
    through the captured function and the hybrid's lookup apart (`SpecStep._looked_up`: its inputs, the page
    tables, vary in width): the rows of one call with the context, for a request whose lookup matches and ones
    whose does not. (Eagerly, the chain's launches cost a joining step ~1.2 ms of host time on an H100.)"""
    from specchat.engine.drafters import hybrid
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.engine.runner import TokenContext
    from specchat.engine.spec_step import SpecStep
    from tests.engine.test_drafters import random_heads

    model = tiny_engine.model
    assert model.cfg.vocab_size > 100
    drafter = hybrid.NgramThenHeads(HeadsDrafter(random_heads(model, num_heads=4), model, cpu_blocks=False))
    tiny_engine.drafters["ngram+heads:apart"] = drafter
    k, q, page = 3, 4, 16
    # three requests of two pages each, fed from positions 10, 12 and 8: the first repeats 11 12 13 14, the
    # others never repeat
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    starts = torch.tensor([10, 12, 8])
    ids = torch.zeros(6 * page, dtype=torch.long)
    ids[:32] = torch.tensor([11, 12, 13, 14] * 8)
    ids[32:64] = 40 + torch.arange(32)
    ids[64:] = 70 + torch.arange(32)
    tokens = ids.view(-1, page)[tables.long()].flatten(1)  # [3, 32] each request's tokens by position
    fed = torch.stack([tokens[r, s : s + q] for r, s in enumerate(starts.tolist())])
    # accepted 3 (its newest, 13, continues the pattern), 1 and 0
    target = torch.tensor([[14, 11, 12, 13], [53, 99, 98, 97], [96, 95, 94, 93]])
    hidden = [
        torch.randn(3, q, model.cfg.hidden_size, generator=torch.Generator().manual_seed(t)) for t in drafter.taps
    ]
    context = TokenContext(ids, tables, starts, page)
    spec = tiny_engine.spec_step
    key = ("ngram+heads:apart", id(drafter), k)
    whole, *rows = spec._verdicts_and_drafts(key, target, fed, *hidden, context=context)
    chain, *rows_apart = spec._verdicts_and_drafts(key, target, fed, *hidden)
    assert torch.equal(SpecStep._looked_up(drafter, k, chain, context), whole)
    assert all(torch.equal(a, b) for a, b in zip(rows_apart, rows, strict=True))
    assert whole[:, 0].tolist() == [3, 1, 0] and whole[:, -1].tolist() == [1, 0, 0]  # the lookup drafted the first
    assert whole[0, 2 + q : 2 + q + k].tolist() == [14, 11, 12]
    assert torch.equal(whole[1:, 2 + q : 2 + q + k], chain[1:, 2 + q : 2 + q + k])  # the heads, the others
