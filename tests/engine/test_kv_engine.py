"""The KV cache inside the engine: page formats end to end, shared prefixes, the live format switch, pool
exhaustion, memory accounting and the --kv / --kv-memory options."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from specchat.config import EngineConfig, SamplingParams
from specchat.engine.engine import Engine
from specchat.engine.sequence import TextDelta
from specchat.errors import ConfigError, KVCacheFullError
from tests.conftest import save_tiny_hf

PROMPT = "Write a Python function that returns the n-th Fibonacci number, and explain it briefly."


def greedy(engine: Engine, prompt, n: int, switches: dict[int, str] | None = None) -> list[int]:
    """Greedy tokens for a prompt; switches maps a count of generated tokens to a KV format to switch to."""
    switches = dict(switches or {})
    handle = engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    for event in handle.events():
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        for at in [a for a in switches if len(tokens) >= a]:
            engine.set_kv(switches.pop(at))
    return handle.finished.token_ids


@pytest.fixture(scope="module")
def engine():
    """The default model on CPU in float32 with fp32 pages (module-owned: these tests switch its format). Float
    activation rows, as the session's default_engine: these tests compare token streams across KV formats, and the
    int8 rows' own rounding (the default where the CPU has AVX512-VNNI or AVX2) would blur what the page format
    changes (tests/engine/test_cpu_act.py covers the int8 rows)."""
    return Engine.load(EngineConfig(device="cpu", dtype="float32", kv_memory=64 << 20, cpu_act="fp32"))


@pytest.mark.slow
def test_dense_switches_mid_generation_continue_exactly(engine):
    engine.set_kv("fp32")
    plain = greedy(engine, PROMPT, 24)
    engine.pool.clear_prefix_cache()
    switched = greedy(engine, PROMPT, 24, {6: "fp16", 14: "fp32"})
    assert switched == plain


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", "k8v4"])
def test_quantized_switch_mid_generation_continues(engine, fmt):
    engine.set_kv("fp32")
    plain = greedy(engine, PROMPT, 20)
    engine.pool.clear_prefix_cache()
    switched = greedy(engine, PROMPT, 20, {8: fmt})
    assert engine.memory()["kv_format"] == fmt
    assert switched[:8] == plain[:8] and len(switched) == 20
    # the conversation carries on: the tokens right after the switch still follow the fp32 run
    assert switched[8:12] == plain[8:12]
    engine.set_kv("fp32")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp32", "mxfp4"])
def test_shared_prefix_gives_the_same_output(engine, fmt):
    engine.set_kv(fmt)
    engine.pool.clear_prefix_cache()
    system = "You are a careful assistant. Answer in one short paragraph, and never use lists. " * 3
    first = greedy(engine, [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}], 12)
    hits = engine.pool.prefix_hit_tokens
    again = greedy(engine, [{"role": "system", "content": system}, {"role": "user", "content": PROMPT}], 12)
    assert engine.pool.prefix_hit_tokens - hits >= 48  # the system prompt's pages came from the cache
    if fmt == "fp32":
        assert again == first
    else:  # the cached prefix is read back quantized, where the first run's prompt attended to exact values
        assert again[:4] == first[:4]
    engine.set_kv("fp32")


@pytest.mark.slow
def test_memory_accounting(engine):
    engine.set_kv("fp32")
    dense = engine.memory()
    engine.set_kv("mxfp4")
    fp4 = engine.memory()
    engine.set_kv("fp32")
    assert fp4["kv_format"] == "mxfp4" and dense["kv_format"] == "fp32"
    assert 1 - fp4["kv_bytes_per_token"] / fp4["kv_bytes_per_token_bf16"] >= 0.734
    assert fp4["kv_capacity_tokens"] >= 3.7 * dense["kv_capacity_tokens"]  # same memory budget
    for m in (dense, fp4):
        assert m["kv_capacity_bytes"] <= 64 << 20
        assert m["max_sessions"] * m["max_context"] <= m["kv_capacity_tokens"]
    with pytest.raises(ConfigError):
        engine.set_kv("int8")


def test_exhaustion_queues_and_errors_without_harming_others(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", page_size=16)
    alone = Engine.load(config)
    prompts = [list(range(1000, 1040)), list(range(2000, 2045))]
    expected = [greedy(alone, p, 30) for p in prompts]
    # 6 pages of 16 tokens: each request needs up to 5, so they cannot run at once
    small = Engine.load(dataclasses.replace(config, kv_memory=6 * 16 * alone.pool.bytes_per_token))
    assert small.pool.num_pages == 6
    handles = [small.submit(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    too_long = small.submit(list(range(3000, 3120)), SamplingParams(max_tokens=4))
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == expected
    failed = too_long.result()
    assert failed.reason == "error" and "KV cache" in failed.error
    assert small.pool.used_pages == 0


def test_kv_format_is_validated():
    with pytest.raises(ConfigError, match="kv format"):
        EngineConfig(kv_format="int8")
    assert issubclass(KVCacheFullError, Exception)


def test_cli_kv_options(tmp_path, tiny_model_dir):
    from specchat.cli import main

    model = save_tiny_hf(tmp_path / "hd32", {"num_attention_heads": 2, "num_key_value_heads": 1})  # head_dim 32
    args = ["generate", "--prompt", "hello", "--max-tokens", "3", "--device", "cpu", "--json"]
    result = CliRunner().invoke(main, [*args, str(model), "--kv", "mxfp4", "--kv-memory", "8M"])
    assert result.exit_code == 0, result.output
    memory = json.loads(result.output.strip().splitlines()[-1])["stats"]["memory"]
    assert memory["kv_format"] == "mxfp4" and memory["kv_capacity_bytes"] <= 8 << 20
    bad = CliRunner().invoke(main, [*args, str(model), "--kv-memory", "lots"])
    assert bad.exit_code != 0 and "--kv-memory" in bad.output
    # head_dim 16 cannot hold 32-element blocks: one clear error
    bad = CliRunner().invoke(main, [*args, str(tiny_model_dir), "--kv", "k8v4"])
    assert bad.exit_code != 0 and "multiple of 32" in bad.output
