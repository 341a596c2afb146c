"""The MXFP4 model computes exactly what the same model computes with its weights dequantized."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.runner import StepBatch
from specchat.quant.modules import dense_modules, fp4_modules, round_to_nearest, select_linears, swap_modules


def _logits(engine, ids: list[int]) -> torch.Tensor:
    engine.pool.add(-1, [])
    try:
        return engine.runner.forward(StepBatch([-1], [ids], [0], [len(ids)])).logits[0]
    finally:
        engine.pool.free(-1)


@pytest.mark.parametrize(("layers", "rotate"), [("blocks", False), ("all", False), ("blocks", True)])
def test_mxfp4_logits_equal_dequantized_dense_logits(engine, layers: str, rotate: bool) -> None:
    model = engine.model
    ids = engine.tokenizer.encode("def wrap(text, width=70):\n    return text.split()")
    packed = round_to_nearest(model, select_linears(model, layers), "ocp", rotate)
    swap_modules(model, fp4_modules(model, packed, rotate))
    mxfp4 = _logits(engine, ids)  # [T, vocab] through Fp4Linear (packed weights, scratch dequantization)
    swap_modules(model, dense_modules(model, torch.float32))
    dense = _logits(engine, ids)  # [T, vocab] through nn.Linear holding the dequantized values
    torch.testing.assert_close(mxfp4, dense, rtol=1e-5, atol=1e-5)
    assert not torch.equal(mxfp4, _original_logits(engine, ids))  # and quantization did change something


def _original_logits(engine, ids: list[int]) -> torch.Tensor:
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    return _logits(Engine.load(EngineConfig(model=engine.config.model, device="cpu", dtype="float32")), ids)
