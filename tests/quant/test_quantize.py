"""quantize_to_checkpoint, the call behind `specchat quantize`: its settings, what it writes, what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specchat.errors import ConfigError
from specchat.quant import quantize as quantize_module
from specchat.quant.checkpoint import METADATA_FILE, WEIGHTS_FILE
from specchat.quant.quantize import QuantizeSettings, quantize_to_checkpoint


def test_settings_rotate_by_default_for_gptq_only() -> None:
    assert QuantizeSettings().rotate is True
    assert QuantizeSettings(method="rtn").rotate is False
    assert QuantizeSettings(method="rtn", rotate=True).rotate is True


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [("method", "awq", "method"), ("rule", "nearest", "rule"), ("calibration_tokens", 0, "calibration-tokens"),
     ("damp", 0.0, "damp"), ("damp", 1e100, "damp"), ("damp", float("nan"), "damp")],
)  # fmt: skip
def test_bad_settings_are_config_errors(field: str, value, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        QuantizeSettings(**{field: value})


def test_writes_a_checkpoint_and_refuses_to_requantize_it(engine, tiny_model_dir, tmp_path) -> None:
    settings = QuantizeSettings(method="rtn", rule="roundup", layers="blocks,-layers.0.*")
    out = tmp_path / "q"
    args = (engine.model, engine.tokenizer.encode, settings)
    result = quantize_to_checkpoint(*args, tiny_model_dir, "tiny", tiny_model_dir, out)
    assert result.path == out and result.linears == 4 and result.method == "rtn-roundup"
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["source"] == "tiny" and meta["layers"] == "blocks,-layers.0.*" and len(meta["quantized"]) == 4
    with pytest.raises(ConfigError, match="already an MXFP4 checkpoint"):
        quantize_to_checkpoint(*args, out, "q", tiny_model_dir, tmp_path / "again")


def test_a_selection_that_matches_nothing_is_a_config_error(engine, tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ConfigError, match="matches no linear module"):
        quantize_to_checkpoint(
            engine.model, engine.tokenizer.encode, QuantizeSettings(layers="nope"), tiny_model_dir, "tiny",
            tiny_model_dir, tmp_path / "q",
        )  # fmt: skip


def test_out_that_holds_other_files_is_refused_and_left_alone(engine, tiny_model_dir, tmp_path) -> None:
    """The model's own folder as --out had its model.safetensors overwritten by the checkpoint (then a
    shutil.SameFileError traceback); a folder of other files got the checkpoint's files mixed in."""
    before = (tiny_model_dir / WEIGHTS_FILE).read_bytes()
    args = (engine.model, engine.tokenizer.encode, QuantizeSettings(method="rtn"), tiny_model_dir, "tiny")
    with pytest.raises(ConfigError, match="holds a model that is not an MXFP4 checkpoint"):
        quantize_to_checkpoint(*args, tiny_model_dir, tiny_model_dir)
    assert (tiny_model_dir / WEIGHTS_FILE).read_bytes() == before
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds notes\.txt"):
        quantize_to_checkpoint(*args, tiny_model_dir, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    with pytest.raises(ConfigError, match="cannot make"):
        quantize_to_checkpoint(*args, tiny_model_dir, tmp_path / "notes.txt" / "q")


def test_an_interrupted_write_leaves_the_earlier_checkpoint(engine, tiny_model_dir, tmp_path, monkeypatch) -> None:
    out = tmp_path / "q"
    args = (engine.model, engine.tokenizer.encode, QuantizeSettings(method="rtn"), tiny_model_dir, "tiny")
    quantize_to_checkpoint(*args, tiny_model_dir, out)  # an empty --out or an earlier checkpoint is written over
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    save = quantize_module.save_mxfp4_checkpoint

    def cut_short(path: Path, *rest) -> None:
        save(path, *rest)
        (path / WEIGHTS_FILE).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(quantize_module, "save_mxfp4_checkpoint", cut_short)
    with pytest.raises(KeyboardInterrupt):
        quantize_to_checkpoint(*args, tiny_model_dir, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # no partial left beside it


def test_round_to_nearest_reports_progress(engine, tiny_model_dir, tmp_path) -> None:
    """Round to nearest runs ~11 s on the default model on a CPU, and said nothing all that time."""
    heard: list[tuple[str, int, int]] = []
    settings = QuantizeSettings(method="rtn")
    result = quantize_to_checkpoint(
        engine.model, engine.tokenizer.encode, settings, tiny_model_dir, "tiny", tiny_model_dir, tmp_path / "q",
        lambda what, done, total: heard.append((what, done, total)),
    )  # fmt: skip
    assert heard == [("round to nearest", i, result.linears) for i in range(1, result.linears + 1)]
