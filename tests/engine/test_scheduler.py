"""The step in three parts: schedule -> speculation step -> postprocess, on the tiny model.

A request the KV pool cannot hold fails alone; the streamed text is the final text; every request of a step
is charged that step's measured draft and verify times.
"""

from __future__ import annotations

import pytest

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.runner import ModelRunner
from specchat.engine.sequence import Finished, StepEvent, TextDelta
from tests.engine.test_eagle import random_eagle

PAGE_BYTES_FP32 = 2 * 2 * 16 * 2 * 4 * 16  # tiny model: layers * kv heads * head_dim * (k, v) * fp32 * page


@pytest.fixture()
def small_pool_engine(tiny_model_dir):
    from specchat.engine.engine import Engine

    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", kv_format="fp32", kv_memory=6 * PAGE_BYTES_FP32
    )
    return Engine.load(config)


def run_all(engine, handles) -> dict[int, list]:
    events: dict[int, list] = {h.request_id: [] for h in handles}
    while engine.scheduler.has_work():
        for event in engine.step():
            events[event.request_id].append(event)
    return events


def test_a_request_the_pool_cannot_hold_fails_alone(small_pool_engine):
    engine = small_pool_engine
    assert engine.pool.capacity_tokens == 96
    greedy = SamplingParams(max_tokens=200, ignore_eos=True)
    too_long = engine.submit("a b c", greedy)
    short = [engine.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in ("hello", "one two")]
    events = run_all(engine, [too_long, *short])
    failed = events[too_long.request_id][-1]
    assert isinstance(failed, Finished) and failed.reason == "error"
    assert "KV cache full" in failed.error and len(failed.token_ids) > 60  # it ran until the pool was full
    for handle in short:
        done = events[handle.request_id][-1]
        assert isinstance(done, Finished) and done.reason == "length" and len(done.token_ids) == 8
    assert engine.pool.used_pages == 0


def test_streamed_text_is_the_final_text(tiny_engine):
    """Text deltas add up to Finished.text, also when a stop string cuts the answer (held-back text included)."""
    first = tiny_engine.generate("hello", SamplingParams(max_tokens=40, ignore_eos=True))
    text = "".join(e.text for e in first if isinstance(e, TextDelta))
    assert text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    for sampling in (
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]),
    ):
        events = list(tiny_engine.generate("hello", sampling, spec=SpecParams("ngram", k=3)))
        finished = events[-1]
        assert isinstance(finished, Finished)
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == finished.text
    assert stop not in finished.text and finished.reason == "stop"


def test_requests_of_one_step_are_charged_that_steps_times(tiny_engine):
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    for prompt in ("a b a b a b", "x y x y"):
        tiny_engine.submit(prompt, sampling, spec=SpecParams("ngram", k=2), listen_only=True)
    shared = 0
    while tiny_engine.scheduler.has_work():
        records = [e.record for e in tiny_engine.step() if isinstance(e, StepEvent)]
        assert all(r.verify_ms > 0 and r.draft_ms >= 0 for r in records)
        assert len({(r.draft_ms, r.verify_ms) for r in records}) <= 1, records
        shared += len(records) > 1
    assert shared > 0, "the two requests never decoded in the same step"


class PaddingRunner(ModelRunner):
    """The eager runner asking for what the CUDA-graph runner asks: decode steps padded to one width."""

    def __init__(self, model, pool) -> None:
        super().__init__(model, pool)
        self.padded_steps = 0

    def padded_width(self, widths):
        self.padded_steps += max(widths) != min(widths)
        return max(widths)


def test_mixed_k_steps_padded_to_one_width_decode_the_same(tiny_model_dir):
    """The CPU run of the padding the CUDA-graph path relies on: requests drafting different k in one step,
    padded with rows that are never verified, give plain greedy decoding's tokens."""
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    engine.spec_step.runner = runner = PaddingRunner(engine.model, engine.pool)
    engine.drafters["eagle:random"] = random_eagle(engine)  # drafts k tokens every step (mostly rejected)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = "one two three one two three one two"
    specs = [SpecParams("none", k=0), SpecParams("eagle:random", k=1), SpecParams("eagle:random", k=3)]
    specs += [SpecParams("ngram", k=5), SpecParams("eagle:random", k=5)]
    handles = [engine.submit(prompt, sampling, spec) for spec in specs]
    results = [h.result() for h in handles]
    assert runner.padded_steps > 0
    assert all(r.token_ids == results[0].token_ids for r in results[1:])
    assert engine.pool.used_pages == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    real_run = engine.spec_step.run

    def broken(plan):
        raise RuntimeError("device lost")

    engine.spec_step.run = broken
    failed = engine.submit("this one meets the failure", sampling).result()
    assert failed.reason == "error" and "the engine step failed: RuntimeError: device lost" in failed.error
    engine.spec_step.run = real_run
    done = engine.submit("this one comes after it", sampling).result()
    assert done.reason == "length" and len(done.token_ids) == 8
    assert engine.pool.used_pages == 0


def test_tokens_from_is_a_slice_of_all_ids():
    """Sequence.tokens_from (what the scheduler feeds every step) equals slicing the whole token list."""
    from specchat.engine.sequence import Sequence

    seq = Sequence.__new__(Sequence)
    for prompt, output in (([1, 2, 3, 4], [5, 6, 7]), ([1], []), ([1, 2], [3])):
        seq.prompt_ids, seq.output_ids = prompt, output
        for start in range(len(prompt) + len(output) + 2):
            for stop in (None, *range(-1, len(prompt) + len(output) + 2)):
                assert seq.tokens_from(start, stop) == seq.all_ids[start:stop], (prompt, output, start, stop)
        assert seq.newest == seq.all_ids[-1]


def test_a_prompt_beside_decoding_requests_is_fed_in_short_chunks_on_the_cpu(tiny_engine):
    """On the CPU a step that decodes requests feeds at most CPU_CHUNK_BESIDE_DECODING tokens of a prompt, so the
    decoding ones are not held for a whole max-batch-tokens chunk (the default model, a 3,356-token prompt beside a
    stream: its longest gap 2.6 s -> 0.58 s, the prompt's first token as soon); a prompt alone takes the whole
    budget. (test_cpu_act holds a prompt's logits the same however it is chunked.)"""
    from specchat.engine.engine import CPU_CHUNK_BESIDE_DECODING

    scheduler = tiny_engine.scheduler
    assert scheduler.chunk_beside_decoding == CPU_CHUNK_BESIDE_DECODING
    fed: list[list[int]] = []
    plan = scheduler._plan

    def recorded(events, now):
        items = plan(events, now)
        fed.append([len(item.feed) for item in items])
        return items

    scheduler._plan = recorded
    try:
        for chunk, word in ((16, "alpha"), (None, "beta")):  # (other words: nothing from the prefix cache)
            scheduler.chunk_beside_decoding = chunk
            sampling = SamplingParams(max_tokens=30, ignore_eos=True)
            stream = tiny_engine.submit("hello there", sampling)
            for _ in range(3):
                tiny_engine.step()
            fed.clear()
            prompt = tiny_engine.submit(" ".join([word] * 10), SamplingParams(max_tokens=2))
            run_all(tiny_engine, [stream, prompt])
            widest = max(max(sizes) for sizes in fed if len(sizes) > 1)  # steps that decoded beside the prompt
            assert widest == 16 if chunk else widest > 16, fed
    finally:
        scheduler._plan = plan
        scheduler.chunk_beside_decoding = CPU_CHUNK_BESIDE_DECODING
