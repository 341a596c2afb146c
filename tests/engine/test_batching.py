"""Continuous batching: concurrent requests give exactly their single-request outputs; cancellation, a full
KV pool and bad requests affect only the requests concerned."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.sequence import Finished, TextDelta
from specchat.errors import ConfigError, PromptError, SpecchatError
from specchat.kernels import cpu_build, cpu_gemv_i8

PROMPTS = [
    "Hi",
    "Write a Python function that adds two numbers.",
    "List three colors.",
    "Explain recursion to a child in a few sentences, please, using an example about stairs.",
    "def fib(n):",
    "What is 12 * 12?",
    "Translate 'good morning' to French.",
    "Tell me a fact about the moon and another about the sun.",
]
KS = [1, 3, 5, None]


def available_drafters(engine) -> list[str]:
    names = []
    for name in ("none", "ngram", "heads", "draft-model"):
        try:
            engine.drafter(name)
            names.append(name)
        except SpecchatError:
            pass
    return names


def alone(engine, prompt: str, max_tokens: int) -> list[int]:
    return engine.submit(prompt, SamplingParams(max_tokens=max_tokens)).result().token_ids


def run_concurrently(engine, specs: list[SpecParams], max_tokens: list[int]) -> list[Finished]:
    handles = [
        engine.submit(p, SamplingParams(max_tokens=m), spec=s)
        for p, s, m in zip(PROMPTS, specs, max_tokens, strict=True)
    ]
    return [h.result() for h in handles]


@pytest.mark.parametrize("engine_name", ["tiny_engine", pytest.param("default_engine", marks=pytest.mark.slow)])
def test_eight_concurrent_requests_equal_single_runs(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    drafters = available_drafters(engine)
    max_tokens = [12 + 5 * i for i in range(len(PROMPTS))]  # mixed lengths: requests finish at different steps
    expected = [alone(engine, p, m) for p, m in zip(PROMPTS, max_tokens, strict=True)]
    specs = [SpecParams(drafter=drafters[i % len(drafters)], k=KS[i % len(KS)]) for i in range(len(PROMPTS))]
    results = run_concurrently(engine, specs, max_tokens)
    for spec, fin, want in zip(specs, results, expected, strict=True):
        assert fin.token_ids == want, f"drafter {spec.drafter}, k {spec.k}"
    assert engine.pool.used_pages == 0 or engine.pool.num_free_pages == engine.pool.num_pages


def test_the_loading_thread_ends_its_openmp_workers(tiny_model_dir, monkeypatch):
    """An app loads on a worker thread that lives on (Textual's pool): its OpenMP workers, kept, slowed every
    step of the thread that steps (kernels/cpu_build.release_openmp_threads)."""
    from specchat.engine.engine import Engine

    released = []
    monkeypatch.setattr(cpu_build, "release_openmp_threads", lambda: released.append(threading.get_ident()))
    loader = threading.Thread(
        target=lambda: (
            released.append(("loaded on", threading.get_ident()))
            or Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
        )
    )
    loader.start()
    loader.join()
    assert released == [("loaded on", loader.ident), loader.ident]


def test_background_thread_serves_many_callers(tiny_engine, monkeypatch):
    expected = [alone(tiny_engine, p, 10) for p in PROMPTS[:4]]
    released = []  # the loading thread's OpenMP workers end as the engine's thread takes over (cpu_build says why)
    monkeypatch.setattr(cpu_build, "release_openmp_threads", lambda: released.append(threading.get_ident()))
    tiny_engine.start()
    assert released == [threading.get_ident()]
    try:
        results: dict[int, list[int]] = {}

        def consume(i: int) -> None:
            results[i] = tiny_engine.submit(PROMPTS[i], SamplingParams(max_tokens=10)).result().token_ids

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [results[i] for i in range(4)] == expected
        # a request naming a drafter not built yet builds it on its caller's thread, which then ends its workers
        tiny_engine.drafters.by_name.pop("ngram", None)
        caller = threading.Thread(
            target=lambda: tiny_engine.submit(PROMPTS[0], SamplingParams(max_tokens=4), SpecParams("ngram", 2)).result()
        )
        caller.start()
        caller.join(timeout=120)
        assert released[1:] == [caller.ident]
    finally:
        tiny_engine.close()


def test_cancellation_frees_pages(tiny_engine):
    free_before = tiny_engine.pool.num_free_pages
    handle = tiny_engine.submit(PROMPTS[3], SamplingParams(max_tokens=200, ignore_eos=True))
    events = handle.events()
    for event in events:
        if isinstance(event, TextDelta) and event.token_ids:
            break
    assert tiny_engine.pool.num_free_pages < free_before
    handle.cancel()
    fin = handle.result()
    assert fin.reason == "cancelled"
    assert 0 < len(fin.token_ids) < 200
    assert tiny_engine.pool.num_free_pages == free_before


@pytest.mark.skipif(not cpu_gemv_i8.available(), reason="no C compiler or no AVX512-VNNI or AVX2")
def test_full_pool_makes_requests_wait_and_all_finish(tmp_path):
    """Queued and preempted requests (recomputed from their text) give the texts they give alone. On a model whose
    rows take the same kernels whatever the step holds (GGUF blocks, int8 rows): torch's float GEMM rounds a row
    differently by the number of rows, so a dense model's recomputed positions may tip a greedy choice."""
    from specchat.engine.engine import Engine
    from tests.engine.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    big = Engine.load(EngineConfig(model=str(path), device="cpu", cpu_act="int8"))
    max_tokens = 40
    expected = [alone(big, p, max_tokens) for p in PROMPTS]
    per_token = big.pool.bytes_per_token
    # room for about two requests' worth of tokens: the rest must queue (or be preempted and recomputed)
    small = Engine.load(EngineConfig(model=str(path), device="cpu", cpu_act="int8", kv_memory=per_token * 160))
    handles = [small.submit(p, SamplingParams(max_tokens=max_tokens)) for p in PROMPTS]
    saw_waiting = False
    while any(h.finished is None for h in handles):
        small.step()
        saw_waiting |= len(small.scheduler.waiting) > 0
        for h in handles:
            while not h.queue.empty():
                event = h.queue.get()
                if isinstance(event, Finished):
                    h.finished = event
    assert saw_waiting
    assert [h.finished.token_ids for h in handles] == expected
    assert small.pool.num_free_pages == small.pool.num_pages


def test_bad_request_fails_alone(tiny_model_dir, tiny_engine):
    from specchat.engine.engine import Engine

    expected = alone(tiny_engine, PROMPTS[1], 20)
    small = Engine.load(
        EngineConfig(
            model=str(tiny_model_dir), device="cpu", dtype="float32", kv_memory=tiny_engine.pool.bytes_per_token * 64
        )
    )
    good = small.submit(PROMPTS[1], SamplingParams(max_tokens=20))
    with pytest.raises(ConfigError):
        small.submit(PROMPTS[2], SamplingParams(max_tokens=20), spec=SpecParams(drafter="no-such-drafter"))
    too_big = small.submit(list(range(100, 200)), SamplingParams(max_tokens=20))  # 100 tokens > 64 in the pool
    assert too_big.result().reason == "error"
    assert "KV" in too_big.result().error
    assert good.result().token_ids == expected


def test_token_ids_outside_the_vocabulary_are_refused_at_submit(tiny_engine):
    """Inside the step such a prompt failed every request of its batch; submit refuses it with the id."""
    vocab = tiny_engine.model.cfg.vocab_size
    for ids in ([vocab], [-1, 5], [1, "a"], [True, 3]):
        with pytest.raises(PromptError, match="vocabulary"):
            tiny_engine.submit(ids, SamplingParams(max_tokens=2))
    assert tiny_engine.submit([1, vocab - 1], SamplingParams(max_tokens=2)).result().reason in ("length", "stop")


def test_a_text_encoding_past_the_vocabulary_is_refused_at_submit(tiny_engine, monkeypatch):
    """A tokenizer holding tokens the weights have no row for (the `</s>` a GGUF converter adds to a vocabulary
    without it) encoded a text prompt to an id past the embedding: an IndexError traceback in the step."""
    vocab = tiny_engine.model.cfg.vocab_size
    encode = tiny_engine.tokenizer.encode
    monkeypatch.setattr(tiny_engine.tokenizer, "encode", lambda text, **kw: [*encode(text, **kw), vocab])
    with pytest.raises(PromptError, match=f"token {vocab} .*past the model's vocabulary of {vocab}"):
        tiny_engine.submit("say it", SamplingParams(max_tokens=2), raw=True)


def test_an_abandoned_generate_gives_its_pages_back(tiny_engine):
    """A caller that stops reading engine.generate (a break, then the generator closed) cancels its request."""
    free_before = tiny_engine.pool.num_free_pages
    stream = tiny_engine.generate(PROMPTS[3], SamplingParams(max_tokens=200, ignore_eos=True))
    for event in stream:
        if isinstance(event, TextDelta) and event.token_ids:
            break
    assert tiny_engine.pool.num_free_pages < free_before
    stream.close()
    alone(tiny_engine, PROMPTS[1], 4)  # a step applies the cancellation
    assert tiny_engine.pool.num_free_pages == free_before


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: SamplingParams(stop=[5]), "stop"),  # failed inside the step, and every request of its batch
        (lambda: SamplingParams(stop="end"), "stop"),
        (lambda: SamplingParams(max_tokens=1.5), "max-tokens"),
        (lambda: SamplingParams(temperature="0.5"), "temperature"),
        (lambda: EngineConfig(kv_memory=float("nan")), "kv memory"),  # a TypeError while loading
        (lambda: EngineConfig(kv_memory="4M"), "kv memory"),
        (lambda: EngineConfig(eager="yes"), "eager must be True or False"),  # was taken as True
        (lambda: EngineConfig(model=5), "model must be a string"),  # failed later, in the registry
        (lambda: EngineConfig(page_size="16"), "page_size must be an integer"),  # a TypeError comparing it
        (lambda: EngineConfig(tp=2.0), "tp must be an integer"),
    ],
)
def test_api_values_of_the_wrong_kind_are_config_errors(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


def test_engine_config_takes_a_model_path():
    assert EngineConfig(model=Path("/models/m.gguf")).model == "/models/m.gguf"


def test_api_arguments_of_the_wrong_kind_raise_at_the_call(tiny_engine):
    """Not an AttributeError from inside the engine: a ConfigError / PromptError naming what was given."""
    with pytest.raises(ConfigError, match="SamplingParams"):
        tiny_engine.submit("hi", {"max_tokens": 4})
    with pytest.raises(ConfigError, match="SpecParams"):
        tiny_engine.submit("hi", SamplingParams(max_tokens=2), "ngram")
    with pytest.raises(PromptError, match="int"):
        tiny_engine.submit(5, SamplingParams(max_tokens=2))
    with pytest.raises(ConfigError, match="k must be"):
        tiny_engine.set_k(99)
