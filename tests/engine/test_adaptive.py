"""Adaptive K: the controller on its own, and the engine honouring a user's K and changes to it."""

from __future__ import annotations

import itertools

import pytest

from specchat.config import SamplingParams, SpecParams
from specchat.engine.adaptive import AdaptiveK
from specchat.engine.drafters import Draft, Drafter
from specchat.engine.sequence import StepEvent
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
    assert 0 in ks[:10]  # gives up quickly
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


def test_only_tested_positions_learn():
    ctl = AdaptiveK(k_max=4, prior=0.6, ema=0.5)
    ctl.update(4, 1)  # draft 1 accepted, draft 2 rejected, drafts 3 and 4 never judged
    assert ctl.rates == pytest.approx([0.8, 0.3, 0.6, 0.6])


def test_invalid_settings_are_refused():
    with pytest.raises(ConfigError):
        AdaptiveK(k_max=4, ema=0.0)


class FixedDrafter(Drafter):
    """Proposes `k` copies of a token the target practically never picks: every step drafts, none accepted."""

    name = "fixed-wrong"

    def propose(self, seqs, ks):
        return [Draft([0] * k) for k in ks]


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
    tiny_engine.drafters["fixed-wrong"] = FixedDrafter()
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)
    events = step_events(tiny_engine.submit("hello", sampling, SpecParams("fixed-wrong", k=None, k_max=6)))
    ks = [e.record.k for e in events]
    assert ks[0] > 0
    first_idle = ks.index(0)
    assert first_idle < 10 and set(ks[first_idle:]) <= {0, 1} and 1 in ks[first_idle:]
