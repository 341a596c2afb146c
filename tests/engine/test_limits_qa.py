"""The engine at its limits through its public API: stop strings that overlap, a request that fills the KV pool
exactly, the step loop closed under a request in flight."""

from __future__ import annotations

import contextlib
import threading

import pytest

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.sequence import Finished, Sequence, TextDelta


class CharDetok:
    """A stream decoder whose token i is the text table[i]."""

    def __init__(self, table: dict[int, str]) -> None:
        self.table = table

    def push(self, ids: list[int]) -> str:
        return "".join(self.table[i] for i in ids)

    def flush(self) -> str:
        return ""


def streamed(pieces: list[str], stop: list[str], per_step: int) -> tuple[str, Sequence]:
    """The text streamed for tokens decoding to `pieces`, `per_step` tokens a step (a speculative step emits
    several), and the request."""
    table = {10 + i: piece for i, piece in enumerate(pieces)}
    seq = Sequence(
        seq_id=1,
        prompt_ids=[1],
        sampling=SamplingParams(max_tokens=100, stop=stop),
        spec=SpecParams(),
        detok=CharDetok(table),
        eos_ids=frozenset(),
        max_position=1000,
    )
    ids, out = list(table), ""
    for start in range(0, len(ids), per_step):
        seq.append_tokens(ids[start : start + per_step])
        out += seq.take_delta()
        if seq.finish_reason is not None:
            break
    return out, seq


@pytest.mark.parametrize("per_step", [1, 2, 100])
@pytest.mark.parametrize("stop", [["ab", "cab"], ["cab", "ab"]])
def test_the_earliest_stop_string_ends_the_text_whatever_their_order(stop, per_step):
    """Stops ["ab", "cab"] over "xxcab...": "cab" starts first, so the answer is "xx". Cut at each stop in turn, the
    text was "xxc" (the "ab" cut took the "cab" away), and a token at a time the "c" had been streamed already: the
    held-back tail was bounded by the other stop's."""
    out, seq = streamed(list("xxcab and more"), stop, per_step)
    assert (out, seq.text, seq.finish_reason) == ("xx", "xx", "stop")


def test_an_engines_answer_ends_at_the_earliest_of_overlapping_stops(tiny_engine):
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    text = tiny_engine.submit("hello", greedy).result().text
    # a piece of the text whose tail is found first where the piece is: stops [tail, piece] must cut before piece
    at = next(
        i
        for i in range(1, len(text) - 4)
        if text.find(text[i : i + 4]) == i and text.find(text[i + 1 : i + 4]) == i + 1
    )
    piece = text[at : at + 4]
    for stop in ([piece[1:], piece], [piece, piece[1:]]):
        handle = tiny_engine.submit("hello", SamplingParams(max_tokens=40, ignore_eos=True, stop=stop))
        events = list(handle.events())
        finished = events[-1]
        assert finished.reason == "stop" and finished.text == text[:at], stop
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text[:at]


@pytest.fixture(scope="module")
def pool_of_64(tiny_model_dir):
    from specchat.engine.engine import Engine

    page = 2 * 2 * 16 * 2 * 4 * 16  # tiny model: layers * kv heads * head_dim * (k, v) * fp32 * page
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", kv_format="fp32", kv_memory=4 * page
    )
    return Engine.load(config)


@pytest.mark.parametrize(("drafter", "k"), [("none", 0), ("none", None), ("ngram", 2), ("ngram", None)])
def test_a_request_that_fits_the_pool_exactly_runs(pool_of_64, drafter, k):
    """56 prompt tokens and 8 answer tokens in a pool of 64: admission asked room for k_max + 1 = 9 more, "for its
    next step's drafts", and refused it, under `none` too, which never drafts."""
    engine = pool_of_64
    assert engine.pool.capacity_tokens == 64
    prompt = [5, 6, 7, 8] * 14
    finished = engine.submit(prompt, SamplingParams(max_tokens=8, ignore_eos=True), SpecParams(drafter, k)).result()
    assert (finished.reason, len(finished.token_ids), finished.error) == ("length", 8, None)
    assert engine.pool.used_pages == 0


def test_a_request_too_big_for_the_pool_is_refused_with_what_it_needs(pool_of_64):
    engine = pool_of_64
    finished = engine.submit([5, 6, 7, 8] * 16, SamplingParams(max_tokens=8)).result()
    assert finished.reason == "error"
    assert finished.error == "request needs 65 tokens of KV cache, the pool holds 64 (raise --kv-memory)"


def test_closing_the_engine_ends_a_request_in_flight_instead_of_leaving_its_reader_waiting(tiny_engine):
    """close() stopped the step loop and a reader waiting for a live request's events waited on its queue for good
    (a hang). Now the request ends with an error, keeping what it wrote, and a request submitted after is stepped by
    its reader."""
    from specchat.engine.engine import ENGINE_CLOSED

    wrote = threading.Event()

    def listener(events) -> None:
        if any(isinstance(e, TextDelta) and e.token_ids for e in events):
            wrote.set()

    def raising_at_the_end(events) -> None:  # (a listener failing on the closing events must not fail close())
        if any(isinstance(e, Finished) for e in events):
            raise RuntimeError("a listener's own bug")

    tiny_engine.listeners += [listener, raising_at_the_end]
    handle = tiny_engine.submit([5, 6, 7] * 10, SamplingParams(max_tokens=200, ignore_eos=True))
    tiny_engine.start()
    done: list[Finished] = []
    reader = threading.Thread(target=lambda: done.append(handle.result()), daemon=True)
    try:
        reader.start()
        assert wrote.wait(timeout=30)
    finally:
        tiny_engine.close()
        tiny_engine.listeners.remove(listener)
        tiny_engine.listeners.remove(raising_at_the_end)
    reader.join(timeout=30)
    assert done, "the request's reader still waits after close()"
    finished = done[0]
    assert finished.reason == "error" and finished.error == ENGINE_CLOSED and 0 < len(finished.token_ids) < 200
    assert tiny_engine.pool.used_pages == 0 and not tiny_engine.scheduler.has_work()
    after = tiny_engine.submit([5, 6, 7] * 10, SamplingParams(max_tokens=5, ignore_eos=True)).result()
    assert (after.reason, len(after.token_ids)) == ("length", 5)


def test_a_drafter_whose_own_kv_pool_fills_leaves_its_requests_to_plain_steps(tiny_model_dir):
    """An EAGLE head's KV pool is sized from the target's capacity when it is built; a live switch to a smaller KV
    format then holds more tokens in the target than in the head. Its full pool raised KVCacheFullError in the step
    and every request of the batch ended with "the engine step failed". Now those requests verify no drafts while
    the head has no room (plain decoding: the same greedy text), and it takes them up again."""
    from specchat.engine.engine import Engine
    from tests.engine.test_eagle import random_eagle

    page = 2 * 2 * 16 * 2 * 4 * 16  # tiny model: layers * kv heads * head_dim * (k, v) * fp32 * page
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", dtype="float32", kv_format="fp32", kv_memory=96 * page
    )
    engine = Engine.load(config)
    engine.drafters["eagle:random"] = head = random_eagle(engine)
    engine.set_kv("fp16")  # the target holds 3,072 tokens, the head 1,536 + its slack of 1,024
    assert engine.pool.capacity_tokens == 2 * 1536 and head.pool.capacity_tokens < 12 * 240
    prompts = [[5 + i, 6, 7 + i % 3, 8] * 50 for i in range(12)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    drafting = [engine.submit(p, sampling, SpecParams("eagle:random", k=3)) for p in prompts]
    results = [h.result() for h in drafting]
    assert [r.error for r in results] == [None] * 12
    assert sum(r.stats.drafted for r in results) > 0
    plain = [engine.submit(p, sampling).result().token_ids for p in prompts]
    assert [r.token_ids for r in results] == plain
    assert engine.pool.used_pages == 0 and head.pool.used_pages <= 1  # (the head's scratch page)


def test_a_listener_that_keeps_raising_does_not_end_the_step_loop(tiny_engine):
    """A listener (a front end's) that raised again while the loop ended the live requests ended the engine's thread:
    every later request then waited for good. Now each request ends with the engine's error, and the loop goes on
    to serve requests once the listener is gone."""

    def broken(events) -> None:
        raise RuntimeError("listener bug")

    tiny_engine.listeners.append(broken)
    tiny_engine.start()
    done: list[Finished] = []
    try:
        for _ in range(2):
            handle = tiny_engine.submit([5, 6, 7] * 5, SamplingParams(max_tokens=5, ignore_eos=True))
            reader = threading.Thread(target=lambda h=handle: done.append(h.result()), daemon=True)
            reader.start()
            reader.join(timeout=30)
        assert len(done) == 2, "a request waited for good after a listener raised"
        assert all(f.reason == "error" and "listener bug" in f.error for f in done)
        tiny_engine.listeners.remove(broken)
        after = tiny_engine.submit([5, 6, 7] * 5, SamplingParams(max_tokens=5, ignore_eos=True))
        reader = threading.Thread(target=lambda: done.append(after.result()), daemon=True)
        reader.start()
        reader.join(timeout=30)
        assert len(done) == 3 and (done[2].reason, len(done[2].token_ids)) == ("length", 5)
    finally:
        if broken in tiny_engine.listeners:
            tiny_engine.listeners.remove(broken)
        tiny_engine.close()


@contextlib.contextmanager
def ngram_requests(engine, k_maxes, max_tokens: int = 100):
    """Live ngram requests at k = 2, one of each k_max, cancelled (and their results read) at the end."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    handles = [
        engine.submit([5, 6, 7 + i] * 5, sampling, SpecParams("ngram", k=2, k_max=k_max))
        for i, k_max in enumerate(k_maxes)
    ]
    try:
        yield handles
    finally:
        for handle in handles:
            handle.cancel()
            handle.result()


def test_set_k_for_every_request_keeps_each_within_its_own_k_max(tiny_engine):
    """set_k(6) over requests of k_max 8, 4, 8 raised at the second (k must be in [0, 4]): the first had k 6, the
    third kept its k 2, and in the background nobody heard of it. Every request now takes k up to its own k_max; a
    k past the k_max of one named request is refused and changes nothing."""
    from specchat.errors import ConfigError

    with ngram_requests(tiny_engine, (8, 4, 8)) as handles:
        tiny_engine.set_k(6)
        assert [(s.spec.k, s.k) for s in tiny_engine.scheduler.live()] == [(6, 6), (4, 4), (6, 6)]
        with pytest.raises(ConfigError, match=r"\[0, 4\]"):
            tiny_engine.set_k(5, handles[1].request_id)
        assert [s.spec.k for s in tiny_engine.scheduler.live()] == [6, 4, 6]


def test_set_k_is_bounded_by_each_requests_own_k_max(tiny_engine):
    """set_k(12) over requests of k_max 16 was refused with "k must be in [0, 8]": the check before the change took
    SpecParams' default k_max. Every request now takes k up to its own k_max (16 here; 4 for one of k_max 4); a k
    past the largest k_max any request may have is refused saying that bound, and so is a k past one named
    request's own, in the caller also while the engine steps in the background."""
    from specchat.config import K_MAX_LIMIT
    from specchat.errors import ConfigError

    with ngram_requests(tiny_engine, (16, 4, 16), max_tokens=200) as handles:
        tiny_engine.set_k(12)
        assert [(s.spec.k, s.k) for s in tiny_engine.scheduler.live()] == [(12, 12), (4, 4), (12, 12)]
        tiny_engine.set_k(14, handles[0].request_id)
        assert [s.spec.k for s in tiny_engine.scheduler.live()] == [14, 4, 12]
        with pytest.raises(ConfigError, match=rf"k must be in \[0, {K_MAX_LIMIT}\] or 'auto', got {K_MAX_LIMIT + 1}"):
            tiny_engine.set_k(K_MAX_LIMIT + 1)
        tiny_engine.start()
        try:
            with pytest.raises(ConfigError, match=r"k must be in \[0, 4\] or 'auto', got 5"):
                tiny_engine.set_k(5, handles[1].request_id)
        finally:
            tiny_engine.close()


def test_close_from_a_listener_is_refused_and_the_loop_goes_on(tiny_engine):
    """close() called by a listener (on the step loop's own thread) raised "cannot join current thread" and left a
    dead loop marked as running: later requests waited for good."""
    from specchat.errors import ConfigError

    refused = []

    def closing(events) -> None:
        if not refused:
            try:
                tiny_engine.close()
            except ConfigError as exc:
                refused.append(str(exc))

    tiny_engine.listeners.append(closing)
    tiny_engine.start()
    try:
        done = tiny_engine.submit([5, 6, 7] * 4, SamplingParams(max_tokens=4, ignore_eos=True)).result()
    finally:
        tiny_engine.listeners.remove(closing)
        tiny_engine.close()
    assert refused and "another thread" in refused[0]
    assert (done.reason, len(done.token_ids)) == ("length", 4)
