"""The live bf16 <-> MXFP4 toggle: conversations continue, switching back is exact, memory is truthful."""

from __future__ import annotations

import torch

from specchat.config import SamplingParams, SpecParams
from specchat.engine.drafters.eagle import LINEARS
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


def test_memory_counts_the_head_and_keeps_nothing_to_switch_back(engine) -> None:
    dense = engine.memory()
    assert dense["weights_format"] == "bf16" and dense["weights_method"] is None
    assert dense["weights_restore_bytes"] == 0
    engine.set_weights("mxfp4")
    packed = engine.memory()
    assert packed["weights_format"] == "mxfp4" and packed["weights_method"] == "gptq-rot (cached)"
    fp4 = [m for m in engine.model.modules() if isinstance(m, Fp4Linear)]
    assert isinstance(engine.model.lm_head, Fp4Linear) and len(fp4) == 9  # 8 block linears and the head
    linears = sum(m.in_features * m.out_features for m in fp4)
    # 4.25 bits per weight: codes (K/2 bytes a row) + scales (K/32 bytes a row)
    assert packed["linear_weight_bytes"] == sum(m.nbytes for m in fp4) == linears * 17 // 32
    assert packed["linear_weight_bytes_bf16"] == dense["linear_weight_bytes_bf16"] == linears * 2
    assert packed["linear_weight_bytes"] <= 0.28 * packed["linear_weight_bytes_bf16"]
    assert dense["weights_bytes"] - packed["weights_bytes"] == linears * 4 - linears * 17 // 32
    assert packed["weights_restore_bytes"] == 0  # switching back reads the dense weights from a file
    engine.set_weights("bf16")
    assert engine.memory() == dense


def test_switching_back_reloads_the_dense_weights_exactly(engine) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.set_weights("mxfp4")
    engine.set_weights("bf16")
    after = engine.model.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_the_toggled_weights_are_the_cached_gptq_weights(engine, tiny_model_dir) -> None:
    from specchat.quant.checkpoint import cache_dir, read_packed
    from specchat.quant.modules import packed_state

    engine.set_weights("mxfp4")
    cached, meta = read_packed(cache_dir(tiny_model_dir))
    assert meta["method"] == "gptq" and meta["rotation"] == "hadamard32" and "lm_head" in cached
    running = packed_state(engine.model)
    assert sorted(running) == sorted(cached)
    assert all(torch.equal(running[n][0], cached[n][0]) and torch.equal(running[n][1], cached[n][1]) for n in cached)


def test_a_tied_head_is_mxfp4_and_the_embedding_reads_its_rows(tied_model_dir) -> None:
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.fp4_linear import TiedEmbedding, embedding_pointer

    engine = Engine.load(EngineConfig(model=str(tied_model_dir), device="cpu", dtype="float32"))
    model = engine.model
    table = model.embed.weight.clone()
    dense = engine.memory()
    invalidated = []
    engine.runner.invalidate = lambda: invalidated.append(True)  # (what drops a CUDA-graph runner's graphs)
    engine.set_weights("mxfp4")
    assert invalidated == [True]
    assert isinstance(model.lm_head, Fp4Linear) and isinstance(model.embed, TiedEmbedding)
    ids = torch.tensor([[0, 5], [49151, 5]])
    assert torch.equal(model.embed(ids), model.lm_head.dequantized(torch.float32)[ids])  # [2, 2, hidden]
    # what the drafting graphs' signature reads: the head's codes, not a table dequantized anew at each read
    assert embedding_pointer(model.embed) == model.lm_head.codes.data_ptr() == embedding_pointer(model.embed)
    packed = engine.memory()
    # the tied matrix is held once, as MXFP4: no dense embedding is left
    vocab, hidden = table.shape
    assert dense["weights_bytes"] - packed["weights_bytes"] > vocab * hidden * (4 - 17 / 32) - 1
    assert packed["linear_weight_bytes"] <= 0.28 * packed["linear_weight_bytes_bf16"]
    assert engine.submit(PROMPT, GREEDY).result().token_ids
    engine.set_weights("bf16")
    assert isinstance(model.embed, torch.nn.Embedding) and model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, table) and engine.memory() == dense
    assert embedding_pointer(model.embed) == model.embed.weight.data_ptr() and invalidated == [True, True]
    engine.set_kv("fp16")
    assert invalidated == [True, True, True]


def test_loading_with_mxfp4_keeps_no_dense_copy(tiny_model_dir) -> None:
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32")
    original = Engine.load(config).model.state_dict()
    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", weights="mxfp4"))
    memory = engine.memory()
    assert memory["weights_format"] == "mxfp4" and memory["weights_restore_bytes"] == 0
    assert memory["weights_method"] == "gptq-rot (cached)"
    engine.set_weights("bf16")  # the model file's weights, read back
    assert engine.memory()["weights_format"] == "bf16"
    assert not any(isinstance(m, Fp4Linear) for m in engine.model.modules())
    assert torch.equal(engine.model.layers[0].attn.wqkv.weight, original["layers.0.attn.wqkv.weight"])


def test_the_first_toggle_calibrates_once_with_progress(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """No cache yet: `prepare` runs GPTQ with the default settings (the whole calibration text), reporting each
    linear; it leaves the model as it was; the switch and every later engine then read the cache."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.checkpoint import cache_dir, read_metadata

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    heard: list[tuple[str, int, int]] = []
    engine.weights.prepare("mxfp4", progress=lambda *event: heard.append(event))
    assert heard == [("GPTQ", i, 9) for i in range(1, 10)]
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    meta = read_metadata(cache_dir(tiny_model_dir))
    assert meta["layers"] == "all" and meta["gptq"]["calibration_tokens"] > 6000
    made = cache_dir(tiny_model_dir).stat().st_mtime_ns
    engine.set_weights("mxfp4")
    assert engine.memory()["weights_method"] == "gptq-rot (cached)"
    again = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    again.weights.progress = lambda *event: heard.append(event)
    again.set_weights("mxfp4")
    assert len(heard) == 9 and cache_dir(tiny_model_dir).stat().st_mtime_ns == made


def test_without_a_model_file_the_toggle_falls_back_to_round_to_nearest(engine) -> None:
    from specchat.quant.handler import weight_switch

    switch = weight_switch(engine.model, {}, None, None)
    switch.set("mxfp4")
    assert switch.memory()["weights_method"] == "rtn-mse"
    assert not isinstance(engine.model.lm_head, Fp4Linear)  # rounded to nearest, the head costs too much
    assert switch.memory()["weights_restore_bytes"] > 0  # nothing to reload from: kept in memory
    switch.set("bf16")
    assert switch.memory()["weights_restore_bytes"] == 0


def test_toggle_uses_the_cached_gptq_result(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """`specchat quantize MODEL` without --out calibrates once into the cache; the toggle then loads it."""
    from click.testing import CliRunner

    from specchat.cli import main
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from specchat.quant.checkpoint import cache_dir, read_packed
    from specchat.quant.modules import packed_state

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
    made = cache_dir(tiny_model_dir).stat().st_mtime_ns
    assert CliRunner().invoke(main, args).exit_code == 0  # the same settings again: the cache is reused
    assert cache_dir(tiny_model_dir).stat().st_mtime_ns == made


def test_an_eagle_head_takes_the_targets_weights_form(engine, tmp_path) -> None:
    """An EAGLE-3 head's linears follow the target's live switch (MXFP4 with MXFP4 weights, its dense ones back
    after), and one built while the target is MXFP4 starts so; speculation stays lossless on MXFP4."""
    from tests.engine.test_eagle import random_eagle, random_head

    engine.drafters["eagle:rand"] = drafter = random_eagle(engine, graphs=False)
    random_head(engine.model).save(tmp_path / "eagle", {"model": "tiny"})
    engine.set_weights("mxfp4")
    later = engine.drafter(f"eagle:{tmp_path / 'eagle'}")
    assert drafter.weights == later.weights == "mxfp4"
    assert all(isinstance(drafter.head.get_submodule(name), Fp4Linear) for name in LINEARS)
    plain = engine.submit(PROMPT, GREEDY).result().token_ids
    spec = engine.submit(PROMPT, GREEDY, SpecParams("eagle:rand", k=3)).result()
    assert spec.token_ids == plain and spec.stats.drafted > 0
    engine.set_weights("bf16")
    assert drafter.weights == later.weights == "bf16"
    assert not any(isinstance(m, Fp4Linear) for m in drafter.head.modules())


def test_an_eagle_head_reads_a_tied_targets_embedding_as_it_is_now(tied_model_dir) -> None:
    """A switch of a tied target replaces its embedding module (the MXFP4 head's rows, then a dense table again):
    the EAGLE-3 drafter embeds its drafts through the module the target holds now, not the one it was built
    beside, which would keep the dense table alive beside the MXFP4 head."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from tests.engine.test_eagle import random_eagle

    engine = Engine.load(EngineConfig(model=str(tied_model_dir), device="cpu", dtype="float32"))
    engine.drafters["eagle:rand"] = drafter = random_eagle(engine, graphs=False)
    plain = engine.submit(PROMPT, GREEDY).result().token_ids
    engine.set_weights("mxfp4")
    assert drafter.embed is engine.model.embed and drafter.weights == "mxfp4"
    plain_mxfp4 = engine.submit(PROMPT, GREEDY).result().token_ids
    assert engine.submit(PROMPT, GREEDY, SpecParams("eagle:rand", k=3)).result().token_ids == plain_mxfp4
    engine.set_weights("bf16")
    assert drafter.embed is engine.model.embed and isinstance(drafter.embed, torch.nn.Embedding)
    assert engine.submit(PROMPT, GREEDY, SpecParams("eagle:rand", k=3)).result().token_ids == plain
