"""`specchat quantize` -> MXFP4 checkpoint -> `specchat generate DIR`: bit-exact packed weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from specchat.cli import main
from specchat.config import EngineConfig
from specchat.engine.engine import Engine
from specchat.quant.checkpoint import METADATA_FILE, save_mxfp4_checkpoint
from specchat.quant.fp4_linear import RotatedFp4Linear
from specchat.quant.gptq import GptqSettings, calibrate, calibration_sequences
from specchat.quant.modules import packed_state, round_to_nearest, select_linears


@pytest.mark.parametrize(("method", "rotation"), [("rtn", None), ("gptq", None), ("gptq", "hadamard32")])
def test_quantize_save_load_is_bit_exact(engine, tiny_model_dir, tmp_path, method: str, rotation) -> None:
    model = engine.model
    names = select_linears(model, "blocks,lm_head")
    rotate = rotation is not None
    if method == "rtn":
        packed = round_to_nearest(model, names, "roundup", rotate)
    else:
        ids = engine.tokenizer.encode("import heapq\nheapq.heappush(queue, (priority, item))\n" * 8)
        settings = GptqSettings(act_order=True, rotate=rotate)
        packed = calibrate(model, calibration_sequences(ids, 128, 64), names, settings)
    out = tmp_path / "ckpt"
    meta = {"method": method, "rule": "roundup", "rotation": rotation, "layers": "blocks,lm_head"}
    save_mxfp4_checkpoint(out, model, packed, tiny_model_dir, meta)

    loaded = Engine.load(EngineConfig(model=str(out), device="cpu", dtype="float32"))
    reloaded = packed_state(loaded.model)
    assert sorted(reloaded) == sorted(packed)
    for name, (codes, scales) in packed.items():
        assert torch.equal(reloaded[name][0], codes) and torch.equal(reloaded[name][1], scales), name
        assert isinstance(loaded.model.get_submodule(name), RotatedFp4Linear) == rotate
    dense = {k: v for k, v in model.state_dict().items() if k.rpartition(".")[0] not in packed}
    for name, tensor in dense.items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    assert loaded.model.cfg == model.cfg
    memory = loaded.memory()
    expected = (method if method == "gptq" else "rtn-roundup") + ("-rot" if rotate else "")
    assert memory["weights_format"] == "mxfp4" and memory["weights_method"] == expected


def test_quantize_cli_writes_a_checkpoint_generate_loads(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "q"
    runner = CliRunner()
    result = runner.invoke(
        main, ["quantize", str(tiny_model_dir), "--out", str(out), "--method", "rtn", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["method"] == "rtn" and meta["rule"] == "mse" and meta["rotation"] is None
    assert len(meta["quantized"]) == 9 and "lm_head" in meta["quantized"]  # the head too, by default
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    weights_mode = (out / "model.safetensors").stat().st_mode & 0o777
    assert weights_mode == (out / "config.json").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600

    result = runner.invoke(
        main, ["generate", str(out), "-p", "hello", "--max-tokens", "4", "--json", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert len(record["token_ids"]) == 4
    memory = record["stats"]["memory"]
    assert memory["weights_format"] == "mxfp4" and memory["weights_method"] == "rtn-mse"
    assert memory["weights_restore_bytes"] == 0  # loaded packed: nothing dense kept


def test_bad_layer_selection_is_one_line(tiny_model_dir, tmp_path) -> None:
    result = CliRunner().invoke(
        main, ["quantize", str(tiny_model_dir), "--out", str(tmp_path / "q"), "--layers", "nope"]
    )
    assert result.exit_code == 1 and "matches no linear module" in result.output
