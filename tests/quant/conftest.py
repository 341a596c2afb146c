"""Fixtures for the MXFP4 weight tests: a private tiny engine (tests here switch its weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.config import EngineConfig


@pytest.fixture
def engine(tiny_model_dir: Path):
    """A fresh engine on the 2-layer random model, CPU float32, its own to toggle."""
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
