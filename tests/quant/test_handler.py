"""Layer selection and module swapping, a tied embedding following its head."""

from __future__ import annotations

import pytest
import torch

from specchat.quant.fp4_linear import Fp4Linear, TiedEmbedding
from specchat.quant.modules import (
    dense_modules,
    fp4_modules,
    mxfp4_modules,
    round_to_nearest,
    select_linears,
    swap_modules,
)

BLOCK = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")


def test_default_selection_is_every_linear_the_head_included(engine) -> None:
    names = select_linears(engine.model)
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in BLOCK] + ["lm_head"]
    assert select_linears(engine.model, "blocks") == names[:-1]


def test_selection_terms_add_and_remove_in_order(engine) -> None:
    model = engine.model
    assert select_linears(model, "all")[-1] == "lm_head"
    assert select_linears(model, "blocks,-layers.0.*") == [f"layers.1.{m}" for m in BLOCK]
    assert select_linears(model, "layers.*.mlp.w_down,lm_head") == [
        "layers.0.mlp.w_down",
        "layers.1.mlp.w_down",
        "lm_head",
    ]
    with pytest.raises(ValueError, match="matches no linear"):
        select_linears(model, "blocks,layers.7.*")


def test_swap_in_and_back_restores_the_same_modules(engine) -> None:
    model = engine.model
    names = select_linears(model, "layers.1.*")
    before = {n: model.get_submodule(n) for n in names}
    replaced = swap_modules(model, fp4_modules(model, round_to_nearest(model, names)))
    assert all(isinstance(model.get_submodule(n), Fp4Linear) for n in names)
    assert not isinstance(model.get_submodule("layers.0.attn.wqkv"), Fp4Linear)
    swap_modules(model, replaced)
    assert all(model.get_submodule(n) is before[n] for n in names)


def test_a_tied_embedding_follows_its_head(tied_model_dir) -> None:
    """MXFP4 head: the embedding reads its rows (one copy of the matrix); dense again: they share one weight."""
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine

    model = Engine.load(EngineConfig(model=str(tied_model_dir), device="cpu", dtype="float32")).model
    ids = torch.tensor([3, 1, 4, 1, 5])
    swap_modules(model, mxfp4_modules(model, round_to_nearest(model, ["lm_head"])))
    assert isinstance(model.lm_head, Fp4Linear) and isinstance(model.embed, TiedEmbedding)
    rows = model.embed(ids)  # [5, hidden]
    assert torch.equal(rows, model.lm_head.dequantized(torch.float32)[ids])
    assert torch.equal(model.embed.weight, model.lm_head.weight)  # what drafters read: the dequantized values
    swap_modules(model, dense_modules(model, torch.float32))
    assert isinstance(model.embed, torch.nn.Embedding) and model.lm_head.weight is model.embed.weight
    assert torch.equal(model.embed(ids), rows)
