"""The live bf16 <-> MXFP4 toggle: conversations continue, switching back is exact, memory is truthful."""

from __future__ import annotations

import torch

from specchat.config import SamplingParams
from specchat.engine.sequence import TextDelta
from specchat.quant.fp4_linear import Fp4Linear

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPT = "Write a function that wraps text."


def _tokens_until(handle, count: int) -> list[int]:
    """Drive the engine until the request has emitted at least `count` tokens."""
    tokens: list[int] = []
    for event in handle.events():
        if isinstance(event, TextDelta):
            tokens += event.token_ids
            if len(tokens) >= count:
                return tokens
    return tokens


def test_toggle_there_and_back_mid_request_continues_it_exactly(engine) -> None:
    reference = engine.submit(PROMPT, GREEDY).result().token_ids
    handle = engine.submit(PROMPT, GREEDY)
    before = _tokens_until(handle, 8)
    engine.set_weights("mxfp4")
    engine.set_weights("bf16")
    assert len(before) < len(reference)
    assert handle.result().token_ids == reference


def test_toggle_mid_request_runs_the_rest_on_mxfp4_and_back(engine) -> None:
    reference = engine.submit(PROMPT, GREEDY).result().token_ids
    handle = engine.submit(PROMPT, GREEDY)
    before = _tokens_until(handle, 8)
    engine.set_weights("mxfp4")
    assert any(isinstance(m, Fp4Linear) for m in engine.model.modules())
    middle = _tokens_until(handle, 8)  # the same request keeps going on MXFP4 weights
    engine.set_weights("bf16")
    finished = handle.result()
    assert len(finished.token_ids) == GREEDY.max_tokens and finished.reason == "length"
    assert finished.token_ids[: len(before)] == reference[: len(before)]
    assert len(middle) >= 8


def test_conversation_after_toggling_back_equals_the_bf16_one(engine) -> None:
    """Turn 1 on bf16, turn 2 on MXFP4, turn 3 back on bf16 equals turn 3 of the same chat on a bf16 engine."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = engine.submit(messages, GREEDY).result().text
    engine.set_weights("mxfp4")
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And a vegetable?"}]
    second = engine.submit(messages, GREEDY).result().text
    engine.set_weights("bf16")
    messages += [{"role": "assistant", "content": second}, {"role": "user", "content": "And a colour?"}]
    third = engine.submit(messages, GREEDY).result().token_ids

    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    fresh = Engine.load(EngineConfig(model=engine.config.model, device="cpu", dtype="float32"))
    assert fresh.submit(messages, GREEDY).result().token_ids == third


def test_memory_counts_the_running_form_and_the_kept_one(engine) -> None:
    dense = engine.memory()
    assert dense["weights_format"] == "bf16" and dense["weights_method"] is None
    assert dense["weights_restore_bytes"] == 0
    engine.set_weights("mxfp4")
    packed = engine.memory()
    assert packed["weights_format"] == "mxfp4" and packed["weights_method"] == "rtn-mse"
    fp4 = [m for m in engine.model.modules() if isinstance(m, Fp4Linear)]
    block_linears = sum(m.in_features * m.out_features for m in fp4)
    # 4.25 bits per weight: codes (K/2 bytes a row) + scales (K/32 bytes a row)
    assert sum(m.nbytes for m in fp4) == block_linears * 17 // 32
    assert dense["weights_bytes"] - packed["weights_bytes"] == block_linears * 4 - block_linears * 17 // 32
    assert packed["linear_weight_bytes_bf16"] == dense["linear_weight_bytes_bf16"]
    assert packed["weights_restore_bytes"] == block_linears * 4  # the float32 originals, kept to switch back
    engine.set_weights("bf16")
    assert engine.memory() == dense


def test_loading_with_mxfp4_keeps_no_dense_copy(tiny_model_dir) -> None:
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", weights="mxfp4"))
    memory = engine.memory()
    assert memory["weights_format"] == "mxfp4" and memory["weights_restore_bytes"] == 0
    engine.set_weights("bf16")  # the dequantized MXFP4 values, run dense
    assert engine.memory()["weights_format"] == "bf16"
    assert not any(isinstance(m, Fp4Linear) for m in engine.model.modules())
    assert torch.is_tensor(engine.model.layers[0].attn.wqkv.weight)


def test_toggle_uses_the_cached_gptq_result(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """`specchat quantize MODEL` without --out calibrates once into the cache; the toggle then loads it."""
    from click.testing import CliRunner

    from specchat.cli import main
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.checkpoint import cache_dir, read_packed
    from specchat.quant.handler import packed_state

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    args = ["quantize", str(tiny_model_dir), "--device", "cpu", "--calibration-tokens", "256"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    cached, meta = read_packed(cache_dir(tiny_model_dir))
    assert meta["method"] == "gptq" and meta["gptq"]["calibration_tokens"] == 256

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    engine.set_weights("mxfp4")
    assert engine.memory()["weights_method"] == "gptq-rot (cached)"
    running = packed_state(engine.model)
    assert all(torch.equal(running[n][0], cached[n][0]) and torch.equal(running[n][1], cached[n][1]) for n in cached)
