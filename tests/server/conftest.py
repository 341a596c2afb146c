"""The server tests' engine: the tiny model on the CPU, started, one per module."""

from __future__ import annotations

import pytest

from specchat.config import EngineConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    engine.start()
    yield engine
    engine.close()
