"""Adaptive K: the controller on its own, and the engine honouring a user's K and changes to it."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from specchat.config import SamplingParams, SpecParams
from specchat.engine.adaptive import (
    EMA_WEIGHT,
    FIRST_TRIAL_AFTER,
    GAIN_MARGIN,
    GATE_CAPS,
    MARGIN_BATCH,
    MAX_GAIN_MARGIN,
    MAX_TRIAL_EVERY,
    RAMP_AFTER,
    SPIKE,
    STALL_STEPS,
    SWITCH_MARGIN,
    TRIAL_EVERY,
    TRIAL_SHARE,
    TRIAL_STEPS,
    AdaptiveK,
    DraftGate,
    RateMemory,
    StepCosts,
    fold_time,
    gain_margin,
)
from specchat.engine.drafters import Draft, Drafter
from specchat.engine.scheduler import gate_key
from specchat.engine.sequence import StepEvent
from specchat.engine.spec_step import StepPlan
from specchat.errors import ConfigError


def test_expected_tokens_follows_per_position_rates():
    ctl = AdaptiveK(k_max=3, rates=[0.5, 0.5, 0.5])
    assert ctl.expected_tokens(0) == 1.0
    assert ctl.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # (1 - a^(k+1)) / (1 - a)


def test_full_acceptance_drives_k_to_the_maximum():
    ctl = AdaptiveK(k_max=6)
    k = ctl.best_k()
    for _ in range(20):
        k = ctl.update(k, k)
    assert k == 6


def test_rejections_stop_drafting_then_probe_with_one_token():
    ctl = AdaptiveK(k_max=6, probe_every=5)
    k = ctl.best_k()
    ks = []
    for _ in range(30):
        k = ctl.update(k, 0)  # nothing is ever accepted
        ks.append(k)
    assert 0 in ks[:16]  # gives up within a probe interval or two (the rates' EMA weighs each miss 0.15)
    idle_then_probe = ks[ks.index(0) :]
    assert set(idle_then_probe) == {0, 1}
    probes = [i for i, k in enumerate(idle_then_probe) if k == 1]
    assert probes and all(b - a == 5 for a, b in itertools.pairwise(probes))


def test_a_successful_probe_resumes_drafting():
    ctl = AdaptiveK(k_max=4, probe_every=3)
    k = 4
    while k != 1:  # reject until the controller idles and probes
        k = ctl.update(k, 0)
    for _ in range(10):
        k = ctl.update(k, k)  # from now on every draft is accepted
    assert k == 4


def test_a_failed_probe_goes_straight_back_to_idling():
    ctl = AdaptiveK(k_max=4, probe_every=3)
    k = 4
    while not ctl.probing:  # reject every draft until the controller idles and then probes
        k = ctl.update(k, 0)
    assert k == 1 and ctl.update(1, 0) == 0  # the probe's draft rejected: idle again at once
    ks = [k := ctl.update(k, 0) for _ in range(9)]
    assert ks == [0, 1, 0, 0, 1, 0, 0, 1, 0]  # a probe every probe_every steps, the failed probe's step counted


def test_only_tested_positions_learn():
    ctl = AdaptiveK(k_max=4, prior=0.6, ema=0.5)
    ctl.update(4, 1)  # draft 1 accepted, draft 2 rejected, drafts 3 and 4 never judged: they take draft 2's rate
    assert ctl.rates == pytest.approx([0.8, 0.3, 0.3, 0.3])
    ctl.update(4, 4)  # every draft accepted: each position learns from its own result
    assert ctl.rates == pytest.approx([0.9, 0.65, 0.65, 0.65])


def test_positions_never_tested_take_the_deepest_tested_rate():
    """A source that only ever drafted 2 and had both accepted expects the 3rd to be as good, not the prior: the
    n-grams on code prompts stayed at k = 2 for whole answers while the deeper rates sat at 0.6."""
    ctl = AdaptiveK.for_sources(6, ("ngram",))
    ctl.sources["ngram"] = [0.95, 0.95, 0.6, 0.6, 0.6, 0.6]
    ctl.depths["ngram"] = 2
    ctl.step_ms = [5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0]  # each draft costs a tenth of a plain step
    ctl.update(2, 2, source="ngram")
    assert ctl.sources["ngram"][2:] == [ctl.sources["ngram"][1]] * 4
    assert ctl.source_k["ngram"] == 6


def run_timed(ctl: AdaptiveK, step_ms, accept_first_every: int, steps: int = 200) -> list[int]:
    """Drive the controller with synthetic step times step_ms(k); the first draft is accepted every
    `accept_first_every` steps and later drafts never (a_1 = 1 / accept_first_every, a_2.. = 0)."""
    k, ks = ctl.best_k(), []
    for n in range(steps):
        accepted = 1 if k > 0 and n % accept_first_every == 0 else 0
        k = ctl.update(k, accepted, step_ms(k))
        ks.append(k)
    return ks


def test_each_draft_source_keeps_its_own_rates_and_k():
    """ngram+heads: head misses no longer stop the n-gram matches, which stay accepted (and the reverse)."""
    ctl = AdaptiveK.for_sources(4, ("ngram",))
    k = ctl.best_k()
    for _ in range(12):
        k = ctl.update(k, 0)  # the heads ("") miss every draft
        k = ctl.update(k, k, source="ngram")  # every n-gram draft is accepted
    assert ctl.rates[0] < 0.1 and ctl.sources["ngram"][0] > 0.9
    assert k == 4 and ctl.limit("ngram", k) == 4 and ctl.limit("", k) == 0
    assert ctl.limit("ngram", 2) == 2  # never above what the step reserved


def test_a_capped_step_lets_every_source_draft_all_of_it():
    """Where the step's k is its batch's cap (CUDA graphs), every source drafts all of it, whatever its own k."""
    ctl = AdaptiveK.for_sources(4, ("ngram",))
    k = ctl.best_k()
    for _ in range(12):
        k = ctl.update(k, 0)
        k = ctl.update(k, 0, source="ngram")
    assert ctl.limit("", 3) == ctl.limit("ngram", 3) == 0
    ctl.capped = True
    assert ctl.limit("", 3) == ctl.limit("ngram", 3) == 3


def test_a_probe_lets_every_source_draft():
    ctl = AdaptiveK.for_sources(4, ("ngram",))
    ctl.probe_every = 3
    k = 4
    for step in range(100):  # both sources miss until the controller idles and probes
        k = ctl.update(k, 0, source="ngram" if step % 2 else "")
        if ctl.probing:
            break
    assert k == 1 and ctl.limit("ngram", 1) == 1 and ctl.limit("", 1) == 1
    assert ctl.update(1, 1, source="ngram") > 0  # an accepted n-gram probe resumes drafting


def test_a_silent_source_is_probed_while_another_drafts():
    """ngram+heads: after a run of head misses the n-grams kept drafting, so the controller never idled and never
    probed, and the heads stayed silent for the rest of the answer; each source now gets its own probes."""
    ctl = AdaptiveK.for_sources(4, ("ngram",))
    ctl.probe_every = 4
    k = 4
    for _ in range(20):
        k = ctl.update(k, 0)  # the heads ("") miss
    assert ctl.source_k[""] == 0 and ctl.limit("", k) == 0
    probes = []
    for _ in range(12):
        k = ctl.update(k, k, source="ngram")  # the n-grams match and are accepted
        probes.append(ctl.limit("", k))
    assert k == 4 and probes.count(1) >= 2 and set(probes) == {0, 1}, probes
    ctl.update(1, 1)  # the heads' probe is accepted: they draft again
    assert ctl.source_k[""] > 0 and "" not in ctl.source_probes


def test_measured_step_times_decide_whether_drafting_pays():
    # a_1 = 1/2: a drafting step emits 1.5 tokens on average.
    # CPU fp32-like: any verification costs ~1.8 plain steps, so drafting loses; it stops (and only probes).
    fp32 = run_timed(AdaptiveK(k_max=4), lambda k: 60.0 if k == 0 else 108.0 + 2 * k, accept_first_every=2)
    assert set(fp32[40:]) <= {0, 1} and fp32[40:].count(0) > 0.8 * len(fp32[40:])
    # bf16-like: verifying a few more tokens costs ~10% more, so one draft per step pays.
    bf16 = run_timed(AdaptiveK(k_max=4), lambda k: 60.0 if k == 0 else 64.0 + 2 * k, accept_first_every=2)
    assert bf16[40:].count(0) < 0.1 * len(bf16[40:])


def test_timed_controller_measures_a_plain_step_first_and_now_and_then():
    ctl = AdaptiveK(k_max=4, rates=[1.0] * 4)
    assert ctl.update(4, 4, step_ms=70.0) == 0  # no reference time yet: one plain step
    assert ctl.update(0, 0, step_ms=60.0) == 4
    k, ks = 4, []
    for _ in range(130):
        k = ctl.update(k, k, step_ms=60.0 if k == 0 else 70.0)
        ks.append(k)
    assert ks.count(0) == 2  # after every REMEASURE_PLAIN_EVERY drafting steps


def test_step_cost_interpolates_measured_times():
    ctl = AdaptiveK(k_max=6, cost_per_draft=0.1, step_ms=[50.0, None, 60.0, None, 70.0, None, None])
    assert ctl.step_cost(2) == pytest.approx(1.2)
    assert ctl.step_cost(3) == pytest.approx(1.3)  # between measured k = 2 and 4
    assert ctl.step_cost(6) == pytest.approx(1.4 + 0.2)  # past the last measured k: prior slope
    assert ctl.step_cost(1) == pytest.approx(1.1)
    assert AdaptiveK(k_max=2).step_cost(2) == pytest.approx(1.2)  # nothing measured: the prior


def test_invalid_settings_are_refused():
    with pytest.raises(ConfigError):
        AdaptiveK(k_max=4, ema=0.0)


class FixedDrafter(Drafter):
    """Proposes `k` copies of a token the target practically never picks: every step drafts, none accepted."""

    name = "fixed-wrong"

    def propose(self, seqs, ks):
        return [Draft([0] * k) for k in ks]


class OnDevice(FixedDrafter):
    """FixedDrafter as a drafter that drafts up to 4 on the device."""

    name = "on-device"

    def drafts_on_device(self, depth=None):
        return depth is None or depth <= 4


class GatedWrong(FixedDrafter):
    """FixedDrafter as a drafter that gates its own drafts (Drafter.gated_k)."""

    name = "gated-wrong"
    gated_k = 3


def step_events(handle) -> list[StepEvent]:
    return [e for e in handle.events() if isinstance(e, StepEvent)]


def test_user_set_k_is_honoured(tiny_engine):
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    events = step_events(tiny_engine.submit("hello", sampling, SpecParams("fixed-wrong", k=3)))
    # every step drafts 3 tokens, except where fewer than 3 + 1 tokens are left before max_tokens
    assert [e.record.k for e in events] == [3] * (len(events) - 3) + [2, 1, 0]
    assert all(e.k_next == 3 for e in events)


def test_k_change_takes_effect_next_step(tiny_engine):
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    handle = tiny_engine.submit("hello", SamplingParams(max_tokens=12, ignore_eos=True), SpecParams("fixed-wrong", k=1))
    ks = []
    for event in handle.events():
        if isinstance(event, StepEvent):
            ks.append(event.record.k)
            if len(ks) == 2:
                tiny_engine.set_k(3, handle.request_id)
    assert ks[:2] == [1, 1] and ks[2] == 3


def test_auto_k_stops_drafting_a_drafter_that_never_pays(tiny_engine):
    tiny_engine.scheduler.memory = RateMemory()  # a fresh start: no earlier request's rates (see below)
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    sampling = SamplingParams(max_tokens=120, ignore_eos=True)
    events = step_events(tiny_engine.submit("hello", sampling, SpecParams("fixed-wrong", k=None, k_max=6)))
    ks = [e.record.k for e in events]
    assert ks[0] > 0
    # Each rejected draft moves the first rate 15% of the way to 0 (RATE_EMA_WEIGHT): where a k = 1 step costs
    # next to nothing (this 2-layer model), k = 1 keeps paying on paper until the rate is below the floor cost of
    # a draft (MIN_COST_PER_DRAFT), up to ~18 misses from what the first steps left it at. After that mostly idle
    # steps remain, with probes (and the odd step a stall misleads).
    late = ks[40:]
    assert late.count(0) > 0.8 * len(late), ks


def test_a_self_gated_drafter_keeps_its_k_and_its_rates_still_learn(tiny_engine):
    """A drafter with gated_k (the packed CPU heads: their confidence picks each step's length) gets that k every
    step under auto, whatever it accepts; its rates still follow (what the UI shows); a remembered start too."""
    controller = AdaptiveK.for_sources(6, (), gated_k=2)
    assert controller.fixed == 2 and controller.next_k() == 2
    for _ in range(40):
        assert controller.update(1, 0, 4.0) == 2  # every draft rejected: an ungated controller would idle
    assert controller.rates[0] < 0.01
    assert AdaptiveK.for_sources(1, (), gated_k=3).fixed == 1  # never above k_max
    memory = RateMemory()
    memory.remember("heads", controller)
    assert memory.start("heads", AdaptiveK.for_sources(6, (), gated_k=2), 4) == 2
    assert memory.start("heads", AdaptiveK.for_sources(6, (), gated_k=2), 4) == 2  # learnt rates: still fixed
    tiny_engine.drafters["gated-wrong"] = GatedWrong()
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    events = step_events(tiny_engine.submit("hello", sampling, SpecParams("gated-wrong", k=None, k_max=6)))
    drafted = [e.record.k for e in events]
    assert {e.k_next for e in events} == {3} and drafted.count(3) > 0.8 * len(drafted), drafted  # (the end: fewer)
    # a sampled request: its drafts are not gated (the packed heads gate greedy chains), so the controller decides
    sampled = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=1)
    events = step_events(tiny_engine.submit("hello", sampled, SpecParams("gated-wrong", k=None, k_max=6)))
    assert 0 in {e.k_next for e in events}  # never accepted: it idles


def test_rate_memory_folds_finished_requests_and_starts_the_next_from_them():
    memory = RateMemory(weight=0.5)
    fresh = AdaptiveK.for_sources(4, ("ngram",))
    assert memory.start("d", fresh, 3) == 3 and fresh.rates == [fresh.prior] * 4  # nothing learnt yet: unchanged
    first = AdaptiveK.for_sources(4, ("ngram",))
    for _ in range(30):
        first.update(2, 0, 5.0 + random.random())  # the drafter's own drafts: the first always rejected
    first.update(3, 3, 6.0, source="ngram")  # the n-grams: all three accepted
    memory.remember("d", first)
    assert memory.rates[("d", "")] == first.rates and memory.depths[("d", "ngram")] == 3
    assert memory.step_ms["d"] == first.step_ms
    second = AdaptiveK.for_sources(4, ("ngram",))
    second.rates = [1.0] * 4
    second.depths[""] = 1
    memory.remember("d", second)  # folded at weight 0.5 where both tested
    assert memory.rates[("d", "")] == pytest.approx([(a + 1.0) / 2 for a in first.rates])
    assert ("d", "") in memory.rates and ("other", "") not in memory.rates
    nxt = AdaptiveK.for_sources(4, ("ngram",))
    k = memory.start("d", nxt, 4)
    assert nxt.rates == memory.rates[("d", "")] and nxt.sources["ngram"] == memory.rates[("d", "ngram")]
    assert nxt.depths == {"": 1, "ngram": 3} and nxt.step_ms == first.step_ms and k == nxt.next_k()
    assert memory.start("d", AdaptiveK.for_sources(6, ("ngram",)), 4) == 4  # another k_max: not comparable


def test_a_request_starts_from_what_its_drafters_finished_requests_learnt(tiny_engine):
    """A chat's next turn starts from the acceptance the last ones saw instead of the optimistic prior (CPU,
    heads alone, 48-token answers: 1.10x -> 1.16x plain decoding; docs/benchmarks.md, "Fifteenth session")."""
    tiny_engine.scheduler.memory = RateMemory()
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    auto = SpecParams("fixed-wrong", k=None)
    first = step_events(tiny_engine.submit("hello", SamplingParams(max_tokens=40, ignore_eos=True), auto))
    assert first[0].record.k > 0  # the prior: drafting pays until the misses show
    again = step_events(tiny_engine.submit("hello", SamplingParams(max_tokens=8, ignore_eos=True), auto))
    assert again[0].record.k == 0  # the first request's misses: it starts idle
    # a seeded sampled request neither starts from the memory (its k must not depend on what ran before it) ...
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)
    learnt = dict(tiny_engine.scheduler.memory.rates)
    assert step_events(tiny_engine.submit("hello", seeded, auto))[0].record.k > 0
    assert tiny_engine.scheduler.memory.rates == learnt  # ... nor teaches it


def test_a_requests_first_decode_step_is_not_timed_for_its_controller(tiny_engine, monkeypatch):
    """Its drafting indexes the whole prompt (n-grams): kept as the time of its k, that k looked dear until the
    request drafted as many again, which on code edits was never (k stayed one below it)."""
    times = []
    update = AdaptiveK.update
    monkeypatch.setattr(
        AdaptiveK, "update", lambda self, k, a, ms=None, src="": times.append(ms) or update(self, k, a, ms, src)
    )
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    tiny_engine.submit(
        "hello", SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("fixed-wrong", k=None)
    ).result()
    assert times[0] is None and all(t is not None for t in times[1:]), times


def test_a_seeded_sampled_request_chooses_k_without_step_times(tiny_engine, monkeypatch):
    """Its k decides its random draws: chosen from step times, the same seed gave another text on a busier machine."""
    times = []
    update = AdaptiveK.update
    monkeypatch.setattr(
        AdaptiveK, "update", lambda self, k, a, ms=None, src="": times.append(ms) or update(self, k, a, ms, src)
    )
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    texts = [tiny_engine.submit("hello", seeded, SpecParams("fixed-wrong", k=None)).result().token_ids for _ in "ab"]
    assert texts[0] == texts[1] and times and all(t is None for t in times), times
    times.clear()
    tiny_engine.submit(
        "hello", SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("fixed-wrong", k=None)
    ).result()
    assert any(t is not None for t in times)  # greedy (and unseeded) requests are timed


def test_step_costs_interpolate_and_extrapolate_by_rows():
    costs = StepCosts()
    assert costs.symmetric_ms(4, 2) is None  # nothing measured yet
    costs.observe(rows=4, verify_ms=10.0, depth=0, draft_ms=0.0)
    costs.observe(rows=12, verify_ms=14.0, depth=2, draft_ms=1.0)
    assert costs.forward_ms(8) == pytest.approx(12.0)  # between measured row counts
    assert costs.forward_ms(2) == pytest.approx(10.0)  # below: memory-bound, no cheaper
    assert costs.forward_ms(24) == pytest.approx(28.0)  # above: proportional to the rows
    assert costs.symmetric_ms(4, 2) == pytest.approx(14.0 + 2 * 0.5)  # 4 requests x 3 rows, 0.5 ms per draft


def drive_batch(batch: int, forward_ms, steps: int = 300) -> list[int]:
    """One request's controller in a batch of `batch` alike requests, fed symmetric step times; the first draft
    is accepted every other step (a_1 = 0.5)."""
    ctl, costs = AdaptiveK(k_max=4), StepCosts()
    k, ks = ctl.best_k(), []
    for n in range(steps):
        costs.observe(batch * (1 + k), forward_ms(batch * (1 + k)), k, 0.1 * k)
        accepted = 1 if k > 0 and n % 2 == 0 else 0
        k = ctl.update(k, accepted, costs.symmetric_ms(batch, k))
        ks.append(k)
    return ks


def test_drafting_stops_where_the_batch_makes_verification_compute_bound():
    # Memory-bound up to 25 rows (a flat 5 ms), compute-bound beyond: 0.2 ms a row. With a_1 = 0.5 a drafting
    # step emits 1.5 tokens: worth it alone (5 rows cost 5 ms), not at batch 32 (64 rows cost twice 32).
    forward = lambda rows: max(5.0, 0.2 * rows)
    alone = drive_batch(1, forward)
    crowded = drive_batch(32, forward)
    assert alone[50:].count(0) < 0.1 * len(alone[50:])  # 1 + k rows cost nothing extra: draft
    assert crowded[50:].count(0) > 0.8 * len(crowded[50:])  # 32 x (1 + k) rows cost ~(1 + k) steps: do not


def drive_gate(ms_per_token: dict[bool, float], steps: int = 2000) -> list[bool]:
    """A DraftGate fed whole-step times: each step emits 4 tokens at the given milliseconds per token (the same
    under every cap > 0); whether each step might draft."""
    gate, modes = DraftGate(), []
    for _ in range(steps):
        cap = gate.allow()
        gate.observe(cap, 4 * ms_per_token[cap > 0], 4)
        modes.append(cap > 0)
    return modes


def test_draft_gate_turns_drafting_off_where_plain_steps_emit_tokens_faster():
    """End to end (host work included) plain decoding at 1.0 ms a token beats drafting at 1.6: after its first
    trial the gate keeps drafting off, and tries it again for TRIAL_STEPS steps every TRIAL_EVERY."""
    modes = drive_gate({True: 1.6, False: 1.0})
    late = modes[100:]
    assert late.count(True) <= len(late) * TRIAL_STEPS / TRIAL_EVERY + TRIAL_STEPS  # the trials, no more
    runs = [len(list(group)) for drafts, group in itertools.groupby(late) if drafts]
    assert runs and all(n == TRIAL_STEPS for n in runs[1:-1])
    # where drafting pays it stays on, with short plain trials to notice a change
    late = drive_gate({True: 0.7, False: 1.0})[100:]
    assert late.count(False) <= len(late) * TRIAL_STEPS / TRIAL_EVERY + TRIAL_STEPS


def test_draft_gate_drafts_only_where_drafting_beats_plain_decoding_by_its_margin():
    """A cap timed faster than plain decoding by less than GAIN_MARGIN (within the noise of a gate's timing, and
    of what its steady steps leave out) leaves plain decoding preferred; by more, the cap is preferred."""
    near = DraftGate(ms_per_token={0: 1.0, 2: 1.0 - GAIN_MARGIN / 2, 4: 1.0 - GAIN_MARGIN / 3})
    assert near.preferred() == 0
    clear = DraftGate(ms_per_token={0: 1.0, 2: 1.0 - 2 * GAIN_MARGIN, 4: 1.0 - GAIN_MARGIN / 3})
    assert clear.preferred() == 2
    assert DraftGate(ms_per_token={2: 0.9, 4: 0.8}).preferred() == 4  # plain decoding not timed: the fastest
    # between drafting caps, the one chosen last stays unless another is SWITCH_MARGIN faster
    times = {0: 1.0, 2: 0.7, 4: 0.7 * (1.0 - SWITCH_MARGIN / 2)}
    assert DraftGate(ms_per_token=times, chosen=2).preferred() == 2
    assert DraftGate(ms_per_token=times).preferred() == 4
    assert DraftGate(ms_per_token={**times, 4: 0.6}, chosen=2).preferred() == 4
    # ... where it still beats plain decoding by the margin itself
    # (cap 2 within SWITCH_MARGIN of cap 4, but not GAIN_MARGIN faster than plain decoding)
    times = {0: 1.0, 2: 0.93, 4: 0.895}
    assert times[4] <= 1.0 - GAIN_MARGIN < times[2] < times[4] / (1.0 - SWITCH_MARGIN)
    assert DraftGate(ms_per_token=times, chosen=2).preferred() == 4


def test_larger_batches_ask_drafting_for_a_larger_margin(tiny_engine):
    """Up to MARGIN_BATCH requests drafting must beat plain decoding by GAIN_MARGIN, beyond it by a margin in
    proportion to the batch (at most MAX_GAIN_MARGIN); the scheduler gives each new gate its bucket's."""
    assert gain_margin(1) == gain_margin(MARGIN_BATCH) == GAIN_MARGIN
    assert gain_margin(4 * MARGIN_BATCH) == pytest.approx(min(MAX_GAIN_MARGIN, 4 * GAIN_MARGIN))
    assert gain_margin(1024) == MAX_GAIN_MARGIN
    scheduler = tiny_engine.scheduler
    for bucket in (1, 8, 32):
        assert scheduler._new_gate((("ngram",), bucket)).margin == gain_margin(bucket)
    try:
        scheduler.gates[("ngram",), 16] = DraftGate(ms_per_token={0: 1.0, 2: 0.7}, chosen=2)
        follower = scheduler._new_gate((("ngram",), 32))  # following the 16-request bucket, with its own margin
        assert follower.margin == gain_margin(32) and follower.preferred() == 0  # 30% faster, not 40%
        assert follower.chosen == 2  # (the neighbour's choice, held against caps within SWITCH_MARGIN)
    finally:
        scheduler.gates.clear()


def test_draft_gate_times_a_cap_by_its_total_time_over_its_total_tokens():
    """One request drafting: its steps emit 1, 1 and 7 tokens in turn in 1.8 ms each (0.6 ms a token) against
    plain steps' 1.0 ms for one. Averaging each step's time per token (1.8, 1.8, 0.26: ~1.3) would price drafting
    above plain decoding; the gate divides the time by the tokens and prefers drafting."""
    gate = DraftGate()
    for i in range(60):
        gate.observe(0, 1.0, 1)
        gate.observe(4, 1.8, (1, 1, 7)[i % 3])
    assert gate.ms_per_token[4] == pytest.approx(0.6, rel=0.25) and gate.preferred() == 4


def test_draft_gate_expects_the_tokens_its_drafts_kept_at_each_position():
    """Drafts of 4 whose first two positions are always kept and the last two never: a step of two requests
    drafting 4 and 1 emits (1 + 2) + (1 + 1) tokens on average; plain steps emit one a request."""
    gate = DraftGate()
    for _ in range(200):
        gate.observe_drafts([(4, 2), (0, 0)])
    assert gate.expected_tokens([4, 1]) == pytest.approx(5.0, abs=0.05)
    assert gate.expected_tokens([0, 0, 0]) == 3.0
    # drafts of 2 never kept say nothing of positions 3 and 4, but no request keeps 3 drafts without the first 2:
    # a cap of 4 is not priced as if they were kept at the prior's 0.6 (1 + 0.6 + 0.6 tokens)
    never = DraftGate()
    for _ in range(200):
        never.observe_drafts([(2, 0)])
    assert never.expected_tokens([4]) < 1.1
    # a gate for a new bucket starts from what its neighbour learnt
    gate.observe(0, 1.0, 1)
    assert gate.follow().expected_tokens([2]) == pytest.approx(3.0, abs=0.05)


def drive_one_request(priced_by_kept: bool, steps: int = 4000, stalls: bool = False) -> tuple[list[int], float]:
    """A DraftGate for one request whose drafts are kept at random (per position 0.45, 0.5, 0.6, 0.75, then 0.8,
    given the ones before), so that a step emits 1 to k + 1 tokens; steps take 0.925 ms plain and 1.05-1.12 ms
    drafting (the H200 at one session, 3% noise). Its caps, and its speed against plain decoding after the
    first 400 steps. `priced_by_kept`: the gate is told the tokens the step's drafts emit on average, else those
    it emitted. `stalls`: every 700 steps the machine stalls for 9, each step taking 2-12x its time (as an H100
    did at one session, benchmarks/gate_trace.py)."""
    rng = random.Random(0)
    keep = (0.45, 0.5, 0.6, 0.75, 0.8, 0.8, 0.8, 0.8)
    step_ms = {0: 0.925, 1: 1.05, 2: 1.06, 4: 1.08, 8: 1.12}
    gate, caps, ms_total, tokens_total = DraftGate(), [], 0.0, 0
    for i in range(steps):
        cap = gate.allow()
        kept = 0
        while kept < cap and rng.random() < keep[kept]:
            kept += 1
        ms = step_ms[cap] * rng.lognormvariate(0.0, 0.03)
        if stalls and i % 700 >= 691:
            ms *= rng.uniform(2.0, 12.0)
        gate.observe_drafts([(cap, kept)])
        gate.observe(cap, ms, gate.expected_tokens([cap]) if priced_by_kept else 1 + kept)
        caps.append(cap)
        if i >= 400:
            ms_total, tokens_total = ms_total + ms, tokens_total + 1 + kept
    return caps, tokens_total / ms_total * step_ms[0]


def test_draft_gate_prices_caps_by_the_tokens_their_drafts_keep_on_average():
    """Larger caps are faster here (k = 4: 1.7x plain, k = 8: 1.8x). Priced by the tokens each step emitted, a
    cap's time per token swings by a quarter from trial to trial: the preferred cap follows whichever was lucky
    and a cap no longer preferred keeps its unlucky time, so the gate ran mostly plain (1.07x plain). Priced by
    the tokens its drafts keep on average, it drafts at 4 or 8 and runs at 1.7x."""
    caps, speed = drive_one_request(priced_by_kept=True)
    late = caps[400:]
    assert late.count(4) + late.count(8) > 0.95 * len(late) and speed > 1.6
    caps, speed = drive_one_request(priced_by_kept=False)
    assert caps[400:].count(0) > 0.5 * len(late) and speed < 1.2


def test_draft_gate_leaves_out_the_stalls_of_the_machine():
    """Bursts of stalled steps are not the cost of the cap they fall on. Counted (at SPIKE x, as before the
    fortieth session), each raised its cap's price, the gate moved to another cap and stalled it too, and the
    drafting caps kept stalled prices until their next trial: the gate ran caps 0-2 45% of the time, 1.45x plain
    decoding (stalls included). Left out, it drafts at 4 or 8 through them (1.63x; 1.76x with no stalls); a cost
    that stays up for STALL_STEPS steps in a row still counts, and a step is judged by its own time, not by its time
    x its requests, which grows when the bucket's batch does."""
    caps, speed = drive_one_request(priced_by_kept=True, steps=6000, stalls=True)
    late = caps[400:]
    assert late.count(4) + late.count(8) > 0.95 * len(late) and speed > 1.55
    gate = DraftGate()
    gate.observe(0, 1.0, 1)
    for _ in range(STALL_STEPS - 1):
        gate.observe(0, 5.0, 1)
    assert gate.ms_per_token[0] == 1.0  # a stall, left out
    gate.observe(0, 5.0, 1)
    assert gate.ms_per_token[0] == pytest.approx(1.0 + EMA_WEIGHT * (SPIKE - 1.0))  # it lasted: the cost changed
    gate = DraftGate()
    for requests in [17] * 20 + [32] * 10:  # one bucket's batch grows: each step of 32 takes as long as one of 17
        gate.observe(0, 1.0, requests, requests)
    assert gate.steps == 30 and gate.ms_per_token[0] == pytest.approx(1.0)


def test_running_times_of_one_shape_leave_out_stalls_and_those_that_move_with_the_batch_are_clamped():
    """fold_time: a time above SPIKE x the running one is left out until STALL_STEPS come in a row (then each
    counts at SPIKE x, the run going on); a normal one ends the run. The engine's forward time per row count keeps
    its times so, as the draft gate does; a request's controller (fed symmetric step times, which move with its
    batch) and the drafting time per position (one for every batch size) take a jump at SPIKE x at once."""
    t, slow = 1.0, 0
    for _ in range(STALL_STEPS - 1):
        t, slow, counted = fold_time(t, 5.0, slow, 0.5)
        assert t == 1.0 and counted is None
    for expect in (1.25, 1.5625):
        t, slow, counted = fold_time(t, 5.0, slow, 0.5)
        assert t == pytest.approx(expect) and counted is not None
    t, slow, counted = fold_time(t, 1.5, slow, 0.5)
    assert slow == 0 and counted == 1.5
    assert fold_time(0.0, 1.0, 0, 0.5) == (1.0, 0, 1.0)  # a zero time is no reference
    ctl = AdaptiveK(4)
    ctl.update(0, 0, 1.0)
    ctl.update(0, 0, 9.0)
    assert ctl.step_ms[0] == pytest.approx(1.0 + ctl.ema * (SPIKE - 1.0))
    costs = StepCosts()
    costs.observe(5, 2.0, 4, 1.0)
    costs.observe(5, 20.0, 4, 10.0)
    assert costs.verify_ms[5] == 2.0
    assert costs.draft_ms_per_position == pytest.approx(0.25 + costs.ema * (SPIKE - 1.0) * 0.25)


def test_draft_gate_decodes_plainly_until_a_trial_times_drafting_faster():
    """A new batch size starts with plain steps (on CUDA graphs they run ahead; a batch drafting where it does not
    pay runs at up to half speed); the first trial, of cap 1, comes after FIRST_TRIAL_AFTER steps. Cap 1 timed
    within CLIMB_MARGIN of plain decoding, cap 2 gets a trial RAMP_AFTER steps later (one draft may barely pay
    where more do); where that is no faster either (each controller chose k = 0, say), plain decoding stays and
    each trial that confirmed it doubled the wait for the next."""
    gate, caps = DraftGate(), []
    for _ in range(FIRST_TRIAL_AFTER + 2 * TRIAL_STEPS + RAMP_AFTER + 4 * TRIAL_EVERY):
        caps.append(gate.allow())
        gate.observe(caps[-1], 4.0, 4)  # as fast as plain steps, whatever the gate allowed
    runs = [(cap, len(list(steps))) for cap, steps in itertools.groupby(caps)]
    assert runs[:4] == [(0, FIRST_TRIAL_AFTER), (1, TRIAL_STEPS), (0, RAMP_AFTER), (2, TRIAL_STEPS)]
    assert runs[4][0] == 0 and len(runs) == 5 and gate.preferred() == 0
    assert gate.every == 4 * TRIAL_EVERY


def test_draft_gate_climbs_from_plain_decoding_while_drafting_more_gets_faster():
    """Per token, plain decoding 1.0 ms; cap 1 1.03 ms (within CLIMB_MARGIN), cap 2 0.95, cap 4 0.85: the trials
    climb past the cap that barely lost to plain decoding and settle at 4. Where cap 2 is slower than cap 1 (1.1
    against 1.03), the climb stops there and plain decoding stays."""
    for ms_per_token, preferred in (({0: 1.0, 1: 1.03, 2: 0.95, 4: 0.85, 8: 0.88}, 4), ({0: 1.0, 1: 1.03, 2: 1.1}, 0)):
        gate, caps = DraftGate(), []
        for _ in range(400):
            caps.append(gate.allow())
            gate.observe(caps[-1], 4 * ms_per_token[caps[-1]], 4)
        assert gate.preferred() == preferred
        assert 4 not in caps if preferred == 0 else caps[-100:].count(4) > 90


def test_draft_gate_climbs_from_plain_decoding_only_while_a_cap_gains_on_half_it():
    """From plain decoding, where cap 2 is timed within CLIMB_GAIN of cap 1 and neither beats plain decoding by
    the batch's margin (32 requests: 40%), cap 4 gets no trial (on the H200 at 32 sessions: caps 1 and 2 at
    0.809 and 0.807 ms a token against plain's 1.089); where cap 2 gains 10% on cap 1, cap 4 gets its trial."""
    for cap2, tried in ((0.806, False), (0.73, True)):
        gate, caps = DraftGate(margin=gain_margin(32)), []
        for _ in range(FIRST_TRIAL_AFTER + 2 * TRIAL_STEPS + 3 * RAMP_AFTER + 8):
            caps.append(gate.allow())
            gate.observe(caps[-1], 4 * {0: 1.089, 1: 0.809, 2: cap2, 4: 0.70, 8: 0.7}[caps[-1]], 4)
        assert (4 in caps) == tried and gate.preferred() == 0


def test_draft_gate_climbs_caps_while_each_is_faster():
    """Where drafting pays more the more it drafts, the cap climbs 1 -> 2 -> 4 -> 8 by trials RAMP_AFTER steps
    apart; where k = 1 pays and k = 2 does not, it stays at 1 (and plain decoding and cap 2 get trials in turn)."""

    def run(ms_per_token: dict[int, float], steps: int) -> list[int]:
        gate, caps = DraftGate(), []
        for _ in range(steps):
            caps.append(gate.allow())
            gate.observe(caps[-1], 4 * ms_per_token[caps[-1]], 4)
        return caps

    climbing = run({0: 1.0, 1: 0.8, 2: 0.7, 4: 0.6, 8: 0.5}, FIRST_TRIAL_AFTER + 4 * (TRIAL_STEPS + RAMP_AFTER) + 50)
    assert climbing[-50:] == [8] * 50
    assert [c for c, _ in itertools.groupby(climbing)][:5] == [0, 1, 2, 4, 8]
    settled = run({0: 1.0, 1: 0.8, 2: 1.2, 4: 1.5, 8: 2.0}, 4000)
    late = settled[500:]
    assert late.count(1) > 0.95 * len(late) and 4 not in late and 8 not in late
    assert 0 in late and 2 in late  # the trials of both neighbours


def test_draft_gate_tries_no_cap_above_its_top():
    """A gate whose top cap is 4 (its drafters draft at most 4 on the device, on CUDA graphs) climbs to 4 where
    every cap is faster than the one below and then tries only plain decoding, never 8; a gate following it
    keeps that top."""
    gate, caps = DraftGate(top=4), []
    for _ in range(3000):
        caps.append(gate.allow())
        gate.observe(caps[-1], 4 * {0: 1.0, 1: 0.8, 2: 0.7, 4: 0.6, 8: 0.5}[caps[-1]], 4)
    assert 8 not in caps and caps[-50:].count(4) > 40 and 0 in caps[500:]
    assert gate.follow().top == 4


def test_the_gate_of_a_drafter_stops_at_what_it_drafts_on_the_device(tiny_engine):
    """Where the runner pads widths, a batch's gate tries caps up to the deepest its drafters all draft on the
    device (two for a drafter drafting two there, beside one drafting any number); elsewhere, and for drafters
    that draft on the host only or draft any number on the device, up to the largest cap."""
    import torch

    from tests.engine.test_step_ahead import BigramDrafter, ShallowBigram

    table = torch.arange(tiny_engine.model.cfg.vocab_size)
    tiny_engine.drafters["shallow"] = ShallowBigram(table)
    tiny_engine.drafters["bigram"] = BigramDrafter(table)
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    scheduler = tiny_engine.scheduler
    try:
        for uniform, names, top in (
            (True, ("shallow",), 2),
            (True, ("bigram", "shallow"), 2),
            (True, ("bigram",), GATE_CAPS[-1]),
            (True, ("fixed-wrong",), GATE_CAPS[-1]),  # (drafts on the host only)
            (False, ("shallow",), GATE_CAPS[-1]),
        ):
            scheduler.uniform_widths = uniform
            scheduler.gates.clear()
            assert scheduler._new_gate((names, 8)).top == top, (uniform, names)
    finally:
        scheduler.uniform_widths = False
        scheduler.gates.clear()


def test_draft_gate_follows_a_change():
    """When drafting stops paying (the text moves from code edits to prose), the next trial notices it."""
    gate, modes = DraftGate(), []
    for n in range(3000):
        cap = gate.allow()
        fast = 0.6 if n < 1000 else 1.5  # drafting's ms per token; plain is 1.0 throughout
        gate.observe(cap, 4 * (fast if cap else 1.0), 4)
        modes.append(cap > 0)
    assert modes[500:1000].count(True) > 0.9 * 500
    assert modes[2000:].count(True) < 0.1 * 1000


def test_draft_gate_trials_grow_rarer_while_they_confirm_the_preference():
    """Each trial that leaves plain decoding preferred doubles the interval to the next (up to MAX_TRIAL_EVERY),
    so the trials' cost fades; one that changes the preference brings the short interval back."""
    modes = drive_gate({True: 1.6, False: 1.0}, steps=20000)
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[1] > TRIAL_EVERY and gaps[-1] >= MAX_TRIAL_EVERY  # growing, then at the cap
    assert all(b >= a for a, b in itertools.pairwise(gaps))
    assert modes[10000:].count(True) <= 10000 * TRIAL_STEPS / MAX_TRIAL_EVERY + TRIAL_STEPS
    gate = DraftGate(every=MAX_TRIAL_EVERY, ms_per_token={True: 1.6, False: 1.0}, since_trial=MAX_TRIAL_EVERY)
    for _ in range(TRIAL_STEPS + 1):  # a trial in which drafting has become the faster mode
        drafts = gate.allow()
        gate.observe(drafts, 0.2 if drafts else 1.0, 1)
    assert gate.preferred() and gate.every == TRIAL_EVERY


def test_draft_gate_spaces_trials_by_what_the_last_one_cost():
    """A trial of a cap that ran 3x slower than plain decoding costs 16 plain steps' time: the next comes late enough
    that it takes at most TRIAL_SHARE of the steps' time, sooner than doubling alone would allow it (on the H200
    at 8 sessions, trials of drafting twice as slow as plain steps cost the drafters 3-6%)."""
    modes = drive_gate({True: 3.0, False: 1.0}, steps=6000)
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    least = math.ceil(TRIAL_STEPS * (3.0 - 1.0) / TRIAL_SHARE)
    assert 2 * TRIAL_EVERY < least <= MAX_TRIAL_EVERY and gaps and all(gap >= least for gap in gaps)
    # where drafting was barely slower (but not within CLIMB_MARGIN), doubling sets the pace as before
    modes = drive_gate({True: 1.08, False: 1.0}, steps=3000)
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]
    assert starts[1] - starts[0] == 2 * TRIAL_EVERY + TRIAL_STEPS


def test_draft_gate_compares_steps_by_what_each_request_waits():
    """Within one batch bucket, plain steps of 32 requests (32 tokens in 3 ms) against drafting steps of 17 (25
    tokens in 2.5 ms): per request drafting is faster (1.7 against 3 ms a token), though per emitted token of the
    batch it looks slower (0.100 against 0.094 ms), only because fewer requests shared its steps."""
    gate = DraftGate()
    for _ in range(4):
        gate.observe(False, 3.0, 32, 32)
        gate.observe(True, 2.5, 25, 17)
    assert gate.preferred()


def test_padded_runner_drafts_the_gates_cap_for_all(tiny_engine):
    """Where the runner pads every decoding request to the widest (CUDA graphs), every adaptive request drafts its
    gate's cap whatever its own controller chose (a step of one width can run ahead of the host; one of mixed
    widths cannot); elsewhere the cap bounds each request's own k."""
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    spec = SpecParams("fixed-wrong", k=None, k_max=8)
    handles = [tiny_engine.submit(p, SamplingParams(max_tokens=30, ignore_eos=True), spec) for p in ("a", "b", "c")]
    scheduler = tiny_engine.scheduler
    while any(s.in_prefill or s.num_cached != s.num_tokens - 1 for s in scheduler.running) or not scheduler.running:
        tiny_engine.step()
    for seq, k in zip(scheduler.running, (0, 1, 8), strict=True):
        seq.k = k
    try:
        scheduler.gates[("fixed-wrong",), 4] = DraftGate(ms_per_token={4: 1.0, 0: 2.0})  # k <= 4 timed faster
        for uniform, want in ((False, [0, 1, 4]), (True, [4, 4, 4])):
            scheduler.uniform_widths = uniform
            assert [item.k for item in scheduler._plan([], 0.0)] == want
        scheduler.uniform_widths = True
        # a trial of drafting while plain decoding is preferred: of cap 1, each drafts one (its own k = 0 too)
        scheduler.gates[("fixed-wrong",), 4] = DraftGate(ms_per_token={1: 2.0, 0: 1.0}, since_trial=TRIAL_EVERY)
        assert [item.k for item in scheduler._plan([], 0.0)] == [1, 1, 1]
    finally:
        scheduler.uniform_widths = False
        scheduler.gates.clear()
    for handle in handles:
        handle.result()


def test_a_request_alone_on_a_padded_runner_drafts_its_gates_cap(tiny_engine):
    """Decoding alone where the runner pads widths (CUDA graphs), an adaptive request drafts the cap its gate
    allows or tries even where its own controller chose k = 0 (the gate times whole steps, which the controller
    cannot: otherwise every trial of drafting timed plain steps); elsewhere it keeps its controller's k."""
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    spec = SpecParams("fixed-wrong", k=None, k_max=8)
    handle = tiny_engine.submit("a", SamplingParams(max_tokens=30, ignore_eos=True), spec)
    scheduler = tiny_engine.scheduler
    while not scheduler.running or scheduler.running[0].num_cached != scheduler.running[0].num_tokens - 1:
        tiny_engine.step()
    scheduler.running[0].k = 0
    for uniform, gate, want in (
        (False, DraftGate(ms_per_token={2: 1.0, 0: 2.0}), [0]),
        (True, DraftGate(ms_per_token={2: 1.0, 0: 2.0}), [2]),  # the gate prefers 2
        (True, DraftGate(ms_per_token={0: 1.0}, since_trial=TRIAL_EVERY), [1]),  # its trial of cap 1
    ):
        scheduler.uniform_widths = uniform
        scheduler.gates[("fixed-wrong",), 1] = gate
        assert [item.k for item in scheduler._plan([], 0.0)] == want
    scheduler.uniform_widths = False
    scheduler.gates.clear()
    handle.result()


def test_a_hybrid_request_on_a_padded_runner_drafts_its_gates_cap_from_both_sources(tiny_engine):
    """ngram+heads alone on a padded runner (CUDA graphs): its gate's cap is drafted in full by either source,
    though its own controller's rates keep both at k = 0 (they do not see the steps run ahead; on the H200 such
    limits made every trial of the gate draft nothing: --k auto at 1.00x plain where k = 4 ran 1.62x)."""
    from specchat.engine.drafters.heads import HeadsDrafter
    from specchat.engine.drafters.hybrid import NgramThenHeads
    from tests.engine.test_drafters import random_heads

    heads = HeadsDrafter(random_heads(tiny_engine.model, num_heads=4), tiny_engine.model, cpu_blocks=False)
    tiny_engine.drafters["hybrid"] = NgramThenHeads(heads)
    spec = SpecParams("hybrid", k=None, k_max=4)
    handle = tiny_engine.submit("a", SamplingParams(max_tokens=30, ignore_eos=True), spec)
    scheduler = tiny_engine.scheduler
    while not scheduler.running or scheduler.running[0].num_cached != scheduler.running[0].num_tokens - 1:
        tiny_engine.step()
    seq = scheduler.running[0]
    for _ in range(12):  # both sources' rates fall to nothing: each source's own k is 0
        seq.adaptive.update(4, 0)
        seq.adaptive.update(4, 0, source="ngram")
    for uniform, want in ((False, 0), (True, 3)):
        scheduler.uniform_widths = uniform
        scheduler.gates[("hybrid",), 1] = DraftGate(ms_per_token={3: 1.0, 0: 2.0})  # the gate prefers 3
        (item,) = scheduler._plan([], 0.0)
        drafts = tiny_engine.spec_step.draft(StepPlan([item]))
        assert len(drafts[0].tokens) == want, uniform
    scheduler.uniform_widths = False
    scheduler.gates.clear()
    handle.result()


def test_best_k_in_one_pass_equals_the_term_by_term_reference():
    rng = random.Random(0)
    for _ in range(5000):
        k_max = rng.randint(0, 8)
        ctl = AdaptiveK(k_max=k_max)
        ctl.rates = [rng.random() for _ in range(k_max)]
        ctl.step_ms = [None if rng.random() < 0.4 else rng.uniform(1.0, 5.0) for _ in range(k_max + 1)]
        assert ctl.best_k() == ctl.best_k_reference(), (ctl.rates, ctl.step_ms)


def test_a_step_the_gate_keeps_from_drafting_costs_no_more_than_plain(tiny_engine):
    """When the DraftGate prefers plain decoding, the step drafts nothing, taps no hidden states for drafters that
    read only the newest row (the heads), drops the row they held (stale from then on) and leaves each request's
    controller as it was (a forced k = 0 says nothing about the drafter)."""
    from specchat.engine.drafters.heads import HeadsDrafter
    from tests.engine.test_drafters import random_heads

    tiny_engine.drafters["heads:gated"] = HeadsDrafter(random_heads(tiny_engine.model), tiny_engine.model)
    sampling, spec = SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("heads:gated", k=None)
    handles = [tiny_engine.submit(prompt, sampling, spec) for prompt in ("hello", "hi there")]
    scheduler = tiny_engine.scheduler
    while len(scheduler.running) < 2 or any(s.in_prefill or not s.hidden for s in scheduler.running):
        tiny_engine.step()
    seqs = list(scheduler.running)
    scheduler.gates[("heads:gated",), 2] = DraftGate(
        ms_per_token={True: 2.0, False: 1.0}
    )  # plain decoding measured faster
    before = [(list(s.adaptive.rates), s.k) for s in seqs]
    plan, _ = scheduler.schedule()
    assert plan.taps == () and [item.k for item in plan.items] == [0, 0]
    scheduler.postprocess(plan, tiny_engine.spec_step.run(plan))
    assert all(s.hidden == {} for s in seqs) and [(s.adaptive.rates, s.k) for s in seqs] == before
    # the step before a trial of drafting still drafts nothing, but taps: the trial's first step has the newest row
    scheduler.gates[("heads:gated",), 2] = DraftGate(ms_per_token={0: 1.0}, since_trial=FIRST_TRIAL_AFTER - 1)
    plan, _ = scheduler.schedule()
    assert plan.taps != () and [item.k for item in plan.items] == [0, 0] and not plan.gated_next
    scheduler.postprocess(plan, tiny_engine.spec_step.run(plan))
    assert all(s.hidden for s in seqs)
    plan, _ = scheduler.schedule()
    assert [item.k for item in plan.items] == [1, 1]  # the trial of cap 1
    scheduler.postprocess(plan, tiny_engine.spec_step.run(plan))
    del scheduler.gates[("heads:gated",), 2]
    for handle in handles:
        handle.result()


def test_a_request_decoding_alone_is_gated_only_where_the_runner_pads_widths(tiny_engine):
    """No DraftGate for a batch of one on an eager runner (the request's own step times are the whole step's);
    on a padding runner (CUDA graphs, where plain steps run ahead and drafting ones cannot) one times it."""
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    spec = SpecParams("fixed-wrong", k=None)
    scheduler = tiny_engine.scheduler
    for uniform, gated in ((False, False), (True, True)):
        scheduler.uniform_widths = uniform
        scheduler.gates.clear()
        handle = tiny_engine.submit("hello", SamplingParams(max_tokens=8, ignore_eos=True), spec)
        handle.result()
        assert ((("fixed-wrong",), 1) in scheduler.gates) == gated, uniform
        if gated:  # the gate starts with plain decoding: nothing drafted until a trial
            assert handle.result().stats.drafted == 0
    scheduler.uniform_widths = False
    scheduler.gates.clear()


def test_plain_decoding_under_k_auto_has_no_controller_and_no_gate(tiny_engine):
    """`none` drafts nothing at any k: under --k auto it decodes at k = 0 with no controller, so no DraftGate holds
    trials of caps for it (steps allowed to draft cannot run ahead on CUDA graphs). Switched to a drafter it
    gets a controller and starts at k = 4; set back to auto under `none`, k = 0 again."""
    scheduler = tiny_engine.scheduler
    scheduler.uniform_widths = True
    scheduler.gates.clear()
    try:
        sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        handle = tiny_engine.submit("hello", sampling, SpecParams("none", k=None))
        assert handle.result().text and not scheduler.gates
        handle = tiny_engine.submit("hello", SamplingParams(max_tokens=64, ignore_eos=True), SpecParams("none"))
        seq = next(s for s in scheduler.live() if s.seq_id == handle.request_id)
        assert seq.adaptive is None and seq.k == 0
        tiny_engine.set_drafter("ngram", handle.request_id)  # (no engine thread here: applied at once)
        assert seq.adaptive is not None and seq.k == 4
        tiny_engine.set_drafter("none", handle.request_id)
        assert seq.adaptive is None and seq.k == 0
        tiny_engine.set_k(None, handle.request_id)
        assert seq.adaptive is None and seq.k == 0
        # beside an adaptive request it keeps no gate from it: the batch of both is gated
        tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
        other = tiny_engine.submit("hi", sampling, SpecParams("fixed-wrong", k=None))
        assert other.result().text and any(names == ("fixed-wrong", "none") for names, _ in scheduler.gates)
        scheduler.gates.clear()  # `none` at a fixed k drafts nothing either
        fixed = tiny_engine.submit("hey", SamplingParams(max_tokens=16, ignore_eos=True), SpecParams("none", k=4))
        assert next(s for s in scheduler.live() if s.seq_id == fixed.request_id).k == 0
        other = tiny_engine.submit("hi", sampling, SpecParams("fixed-wrong", k=None))
        assert other.result().text and fixed.result().text
        assert any(names == ("fixed-wrong", "none") for names, _ in scheduler.gates)
        # nor does it bound the caps of a drafter that drafts up to 4 on the device
        tiny_engine.drafters["on-device"] = OnDevice()
        assert scheduler._gate_top(("none", "on-device")) == scheduler._gate_top(("on-device",)) == 4
        assert handle.result().text
    finally:
        scheduler.uniform_widths = False
        scheduler.gates.clear()


def test_a_seeded_sampled_request_keeps_its_batch_out_of_the_draft_gate(tiny_engine):
    """The gate's caps come from timings and would choose a seeded request's k, and so its random draws."""
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    spec = SpecParams("fixed-wrong", k=None)
    scheduler = tiny_engine.scheduler
    scheduler.uniform_widths = True  # (where a lone request is gated otherwise)
    scheduler.gates.clear()
    try:
        seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
        tiny_engine.submit("hello", seeded, spec).result()
        assert not scheduler.gates
        tiny_engine.submit("hello", SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True), spec).result()
        assert scheduler.gates  # unseeded: gated as before
    finally:
        scheduler.uniform_widths = False
        scheduler.gates.clear()


def _learnt_gate(plain_ms: float, cap_ms: dict[int, float], steps: int = 600) -> DraftGate:
    """A gate driven for `steps` steps where each cap's steps take the given ms per token."""
    gate = DraftGate()
    for _ in range(steps):
        cap = gate.allow()
        gate.observe(cap, cap_ms.get(cap, plain_ms) if cap else plain_ms, 1)
    return gate


def test_a_new_bucket_starts_from_its_neighbours_choice():
    """A gate for a batch size not seen yet follows the neighbouring bucket's: plain decoding where drafting timed
    slower there, with the neighbour's times in proportion to the new bucket's own first one and no trial before
    TRIAL_EVERY steps; drafting at the neighbour's cap where that was faster."""
    old = _learnt_gate(1.0, {1: 1.5, 2: 1.6})
    assert old.preferred() == 0 and 1 in old.ms_per_token
    new = old.follow()
    caps = []
    for _ in range(TRIAL_EVERY + 1):
        cap = new.allow()
        caps.append(cap)
        new.observe(cap, 0.5 * (1.0 if cap == 0 else 1.5), 1)  # the new bucket's steps take half as long
    assert caps[:TRIAL_EVERY] == [0] * TRIAL_EVERY and caps[-1] > 0  # a fresh gate tries cap 1 after 32 steps
    assert new.ms_per_token[1] == pytest.approx(0.5 * old.ms_per_token[1] / old.ms_per_token[0])
    fresh = DraftGate()
    assert [fresh.allow() for _ in range(FIRST_TRIAL_AFTER + 1)][-1] == 1
    drafting = _learnt_gate(1.0, {1: 0.8, 2: 0.7, 4: 0.75, 8: 0.9})
    assert drafting.preferred() == 2
    follower = drafting.follow()
    assert [follower.allow() for _ in range(RAMP_AFTER)] == [2] * RAMP_AFTER  # from its first step


def test_scheduler_starts_a_new_bucket_from_the_adjacent_one_that_timed_most(tiny_engine):
    """Gates are per drafters and batch size bucket; a new one follows an adjacent bucket of the same drafters."""
    assert gate_key(["ngram", "heads", "ngram"]) == (("heads", "ngram"), 4) and gate_key(["ngram"]) == (("ngram",), 1)
    scheduler = tiny_engine.scheduler
    scheduler.gates.clear()
    ngram = ("ngram",)
    scheduler.gates[ngram, 32] = _learnt_gate(1.0, {1: 1.5})
    scheduler.gates[ngram, 8] = _learnt_gate(1.0, {1: 0.5}, steps=100)
    assert scheduler._new_gate((ngram, 16)).prior == scheduler.gates[ngram, 32].follow().prior  # 32 timed more
    assert scheduler._new_gate((ngram, 4)).prior == scheduler.gates[ngram, 8].follow().prior
    assert scheduler._new_gate((ngram, 2)).prior == {} and scheduler._new_gate((ngram, 64)).prior != {}
    assert scheduler._new_gate((ngram, 128)).prior == {}  # two buckets away: a fresh gate
    assert scheduler._new_gate((("heads",), 16)).prior == {}  # another drafter's timings say nothing
    scheduler.gates.clear()


def test_a_step_that_feeds_a_prompt_is_not_timed_for_the_gate(tiny_engine):
    """A step where a prompt runs beside the decoding requests takes several decode steps' time: the gate times
    only steps of decoding requests alone, or plain decoding (the cap most such steps run under) looks slow; and
    of those only the ones after a step of the same kind under the same cap (the first after a prompt could not
    have been launched ahead of the host)."""
    spec = SpecParams("ngram", k=None)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    handles = [tiny_engine.submit(prompt, sampling, spec) for prompt in ("hello", "hi there")]
    scheduler = tiny_engine.scheduler

    def step() -> tuple[bool, bool]:
        """One step by hand: (whether it fed a prompt, whether it is to be timed)."""
        plan, _ = scheduler.schedule()
        assert scheduler._gated is not None
        scheduler.postprocess(plan, tiny_engine.spec_step.run(plan))
        return any(len(item.feed) > 1 for item in plan.items), scheduler._timed is not None

    try:
        while len(scheduler.running) < 2 or any(not scheduler._decodes(s) for s in scheduler.running):
            tiny_engine.step()
        assert step() == (False, False)  # decoding alone, but the first such step after the prompts
        assert step() == (False, True)  # ... and the next: timed at the next schedule
        handles.append(tiny_engine.submit("a third request with a longer prompt", sampling, spec))
        assert step() == (True, False)
        while any(not scheduler._decodes(s) for s in scheduler.running):
            tiny_engine.step()
        assert step() == (False, False)
        assert step() == (False, True)
    finally:
        for handle in handles:
            handle.result()


def test_the_step_before_a_trial_of_drafting_is_not_timed_for_the_gate(tiny_engine):
    """From plain decoding, the step before a trial taps hidden rows for the trial's first drafts and cannot run
    ahead: its time is the trial's, not plain decoding's (it was the freshest plain time whenever a trial was
    judged, pricing plain ~15% high on the H200); the plain steps around it are timed."""
    spec = SpecParams("ngram", k=None)
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)
    handles = [tiny_engine.submit(prompt, sampling, spec) for prompt in ("hello", "hi there")]
    scheduler = tiny_engine.scheduler
    scheduler.gates.clear()  # a fresh gate: FIRST_TRIAL_AFTER plain steps, then a trial of cap 1
    steps = []  # (the gate held drafting off, the next step may draft, the step is timed)
    try:
        while len(scheduler.running) < 2 or any(not scheduler._decodes(s) for s in scheduler.running):
            tiny_engine.step()
        for _ in range(FIRST_TRIAL_AFTER + 4):
            plan, _ = scheduler.schedule()
            scheduler.postprocess(plan, tiny_engine.spec_step.run(plan))
            steps.append((scheduler._gated_off, not plan.gated_next, scheduler._timed is not None))
    finally:
        for handle in handles:
            handle.result()
    before_trial = [timed for off, next_drafts, timed in steps if off and next_drafts]
    plain = [timed for off, next_drafts, timed in steps if off and not next_drafts]
    assert before_trial == [False]
    assert len(plain) >= FIRST_TRIAL_AFTER - 2 and sum(plain) >= len(plain) - 2  # the others are, but the first


def test_draft_gate_peek_tells_what_allow_will_say():
    """`peek` (what a step launched ahead relies on) is the next `allow`, through trials and changes of mind."""
    gate = DraftGate()
    for step in range(1200):
        expected = gate.peek()
        cap = gate.allow()
        assert (cap > 0) == expected, step
        fast = step // 300 % 2 == 0  # drafting pays in the first and third quarters, plain in the others
        gate.observe(cap, 4 * (1.0 if (cap > 0) == fast else 1.6), 4)
