"""Fixtures for the MXFP4 weight tests: a $SPECCHAT_HOME of this session's own (the toggle's caches never land in
the user's), the tiny models' toggle checkpoints calibrated once, and a private tiny engine per test (tests here
switch its weights)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specchat.config import EngineConfig
from tests.conftest import save_tiny_hf

QUICK_CALIBRATION_TOKENS = 256  # the default (8,192) takes ~20 s on a busy CPU; test_toggle.py runs it once


def calibrate_quickly(model_dir: Path) -> None:
    """Put the toggle's GPTQ checkpoint of a tiny model in the cache, calibrated on a few tokens."""
    from specchat.engine.engine import Engine
    from specchat.quant.quantize import QuantizeSettings, quantize_to_checkpoint

    engine = Engine.load(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    settings = QuantizeSettings(calibration_tokens=QUICK_CALIBRATION_TOKENS)
    quantize_to_checkpoint(engine.model, engine.tokenizer.encode, settings, model_dir, "tiny", model_dir)


@pytest.fixture(scope="session", autouse=True)
def specchat_home(tmp_path_factory, tiny_model_dir: Path) -> Path:
    home = tmp_path_factory.mktemp("specchat-home")
    before = os.environ.get("SPECCHAT_HOME")
    os.environ["SPECCHAT_HOME"] = str(home)
    calibrate_quickly(tiny_model_dir)
    yield home
    if before is None:
        del os.environ["SPECCHAT_HOME"]
    else:
        os.environ["SPECCHAT_HOME"] = before


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory, specchat_home: Path) -> Path:
    """The tiny model with its output head tied to the token embedding (as the default model's is)."""
    path = save_tiny_hf(tmp_path_factory.mktemp("tiny-tied"), {"tie_word_embeddings": True, "hidden_size": 128})
    calibrate_quickly(path)
    return path


@pytest.fixture
def engine(tiny_model_dir: Path):
    """A fresh engine on the 2-layer random model, CPU float32, its own to toggle."""
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
