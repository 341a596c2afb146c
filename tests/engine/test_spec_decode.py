"""Speculative decoding through the engine: lossless greedy output, self-drafting, seeds, KV after rejection.

Requests of one test are submitted together, so the scheduler verifies them in one batched forward per step.
"""

from __future__ import annotations

import pytest
import torch

from specchat.config import SamplingParams, SpecParams
from specchat.engine.adaptive import DraftGate
from specchat.engine.drafters.heads import HeadsDrafter
from specchat.engine.drafters.hybrid import NgramThenHeads
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.engine.sequence import StepEvent
from tests.engine.test_drafters import random_heads
from tests.engine.test_eagle import random_eagle

KS = (1, 3, 5)
# A code edit: the answer repeats the prompt, so n-gram drafts get accepted as well as rejected.
EDIT_PROMPT = (
    "Add type hints to this function and return the whole code:\n\n"
    "def total(prices, tax):\n    result = 0\n    for price in prices:\n        result += price * (1 + tax)\n"
    "    return result\n"
)


def run_together(engine, prompt, sampling, specs: list[SpecParams]):
    handles = [engine.submit(prompt, sampling, spec) for spec in specs]
    return [h.result() for h in handles]


def assert_lossless(engine, drafters: list[str], max_tokens: int) -> dict:
    sampling = SamplingParams(max_tokens=max_tokens)
    specs = [SpecParams("none", k=0)] + [SpecParams(d, k=k) for d in drafters for k in KS]
    plain, *spec_runs = run_together(engine, EDIT_PROMPT, sampling, specs)
    stats = {}
    for spec, fin in zip(specs[1:], spec_runs, strict=True):
        assert fin.token_ids == plain.token_ids, f"{spec.drafter} k={spec.k} diverged from plain greedy"
        stats[(spec.drafter, spec.k)] = fin.stats
    return stats


@pytest.fixture(scope="module")
def tiny_heads(tiny_engine, tmp_path_factory):
    """Random sequential and parallel heads for the tiny model, registered under test names."""
    for sequential in (True, False):
        path = tmp_path_factory.mktemp("heads") / "h.safetensors"
        random_heads(tiny_engine.model, sequential=sequential, num_heads=5, draft_vocab=2000).save(path, {})
        name = f"heads:{'seq' if sequential else 'par'}"
        # ungated: random heads are rarely confident, and every step should draft
        tiny_engine.drafters[name] = HeadsDrafter.from_file(path, tiny_engine.model, min_confidence=0.0)
    tiny_engine.drafters["ngram+heads:seq"] = NgramThenHeads(tiny_engine.drafters["heads:seq"])
    tiny_engine.drafters["eagle:rand"] = random_eagle(tiny_engine)
    return ["heads:seq", "heads:par", "ngram+heads:seq", "eagle:rand"]


def test_greedy_is_lossless_on_tiny_model(tiny_engine, tiny_heads):
    own = f"draft-model:{tiny_engine.model_spec.path}"
    stats = assert_lossless(tiny_engine, ["ngram", *tiny_heads, own, "draft-model"], max_tokens=24)
    # random heads are nearly always rejected; the model drafting for itself is always accepted
    assert stats[("heads:seq", 3)].accepted < stats[("heads:seq", 3)].drafted
    assert stats[(own, 3)].accepted == stats[(own, 3)].drafted > 0


@pytest.mark.slow
def test_greedy_is_lossless_on_default_model(default_engine):
    stats = assert_lossless(default_engine, ["ngram", "heads", "ngram+heads", "draft-model"], max_tokens=40)
    assert stats[("ngram", 5)].accepted > 0 and stats[("heads", 3)].accepted > 0


def own_draft_model(engine) -> str:
    """The engine's model drafting for itself (weights shared, its own KV pool)."""
    spec = engine.model_spec
    return f"draft-model:{spec.path or spec.alias}"


@pytest.mark.parametrize("engine_name", ["tiny_engine", pytest.param("default_engine", marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_target_as_its_own_draft_accepts_everything(engine_name, temperature, request):
    engine = request.getfixturevalue(engine_name)
    sampling = SamplingParams(max_tokens=20, temperature=temperature, seed=1, ignore_eos=True)
    handles = [engine.submit("Once upon a time", sampling, SpecParams(own_draft_model(engine), k=k)) for k in (2, 4)]
    for k, handle in zip((2, 4), handles, strict=True):
        steps = [e.record for e in handle.events() if isinstance(e, StepEvent)]
        stats = handle.finished.stats
        assert stats.acceptance_rate == 1.0
        # k + 1 tokens per step, except the last steps, cut short to end exactly at max_tokens
        full = [r for r in steps if r.k == k]
        assert full and all(r.accepted == k and r.emitted == k + 1 for r in full)
        assert all(r.accepted == r.k and r.emitted == r.k + 1 for r in steps)


@pytest.mark.parametrize("drafter", ["ngram", "heads:seq", "eagle:rand", "draft-model"])
def test_seeded_sampling_is_deterministic(tiny_engine, tiny_heads, drafter):
    def run(seed):
        sampling = SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
        return run_together(tiny_engine, EDIT_PROMPT, sampling, [SpecParams(drafter, k=3)] * 2)

    first, second = run(5)
    assert first.token_ids == second.token_ids
    again, _ = run(5)
    assert again.token_ids == first.token_ids
    other, _ = run(6)
    assert other.token_ids != first.token_ids


@pytest.mark.parametrize(
    ("engine_name", "drafter"),
    [("tiny_engine", "heads:seq"), pytest.param("default_engine", "ngram", marks=pytest.mark.slow)],
)
def test_kv_after_rejection_matches_fresh_prefill(engine_name, drafter, tiny_heads, request):
    engine = request.getfixturevalue(engine_name)
    handle = engine.submit(EDIT_PROMPT, SamplingParams(max_tokens=64, ignore_eos=True), SpecParams(drafter, k=5))
    rejected = False
    try:
        while not rejected:
            events = engine.step()
            assert engine.scheduler.running, "finished without a rejected draft"
            rejected = any(isinstance(e, StepEvent) and e.record.accepted < e.record.k for e in events)
        seq = next(s for s in engine.scheduler.running if s.seq_id == handle.request_id)
        ids = seq.all_ids
        assert engine.pool.length(seq.seq_id) == seq.num_cached == len(ids) - 1
        # The newest token's logits from the cache left after truncation ...
        cached = engine.runner.forward(StepBatch([seq.seq_id], [ids[-1:]], [seq.num_cached], [1])).logits[0]
        engine.pool.truncate(seq.seq_id, seq.num_cached)
        # ... equal those of a fresh prefill of the accepted sequence in a pool of its own.
        c = engine.model.cfg
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 16, torch.float32, "cpu")
        pool.add(0, ids)
        fresh = ModelRunner(engine.model, pool).forward(StepBatch([0], [ids], [0], [1])).logits[0]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)
    finally:
        handle.cancel()
        handle.result()


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)


def seeded_alone(engine, spec: SpecParams) -> list[int]:
    return engine.submit(EDIT_PROMPT, SEEDED, spec).result().token_ids


@pytest.mark.parametrize("drafter", ["ngram", "heads:seq", "heads:par", "ngram+heads:seq", "eagle:rand", "draft-model"])
def test_seeded_text_does_not_depend_on_the_batch(tiny_engine, tiny_heads, drafter):
    """A seeded request's random draws come from its own generator, as many as its own k asks for: beside
    requests of the same drafter drafting deeper (sampled and greedy) it gives the text it gives alone."""
    spec = SpecParams(drafter, k=1)
    alone = seeded_alone(tiny_engine, spec)
    neighbours = [(SamplingParams(max_tokens=32, temperature=1.0), 5), (SamplingParams(max_tokens=32), 4)]
    handles = [tiny_engine.submit("Once upon a time", sp, SpecParams(drafter, k=k)) for sp, k in neighbours]
    assert seeded_alone(tiny_engine, spec) == alone
    for handle in handles:
        handle.result()


@pytest.mark.parametrize("drafter", ["heads:seq", "ngram+heads:seq"])
def test_seeded_text_does_not_depend_on_a_gated_batch(tiny_engine, tiny_heads, drafter, monkeypatch):
    """A seeded adaptive request whose prompt ends in a step where its neighbours' DraftGate holds drafting off
    (and will next step) still has its hidden row tapped: it drafts from its first decoding step, as alone."""
    monkeypatch.setattr(DraftGate, "allow", lambda self: 0)
    monkeypatch.setattr(DraftGate, "peek", lambda self: False)
    spec = SpecParams(drafter)  # k auto
    alone = seeded_alone(tiny_engine, spec)
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    handles = [tiny_engine.submit(f"Once upon a time {i}", sampling, spec) for i in range(2)]
    running = tiny_engine.scheduler.running
    while len(running) < 2 or not all(seq.output_ids for seq in running):  # both decode: the gate holds them
        tiny_engine.step()
    assert seeded_alone(tiny_engine, spec) == alone
    for handle in handles:
        handle.result()
