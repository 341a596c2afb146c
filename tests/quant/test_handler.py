"""Layer selection and module swapping."""

from __future__ import annotations

import pytest
import torch

from specchat.quant.fp4_linear import Fp4Linear
from specchat.quant.handler import fp4_modules, round_to_nearest, select_linears, swap_modules

BLOCK = ("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")


def test_default_selection_is_every_block_linear_and_not_the_head(engine) -> None:
    names = select_linears(engine.model)
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in BLOCK]


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


def test_quantizing_the_tied_head_leaves_the_embedding_dense(tiny_model_dir) -> None:
    from specchat.config import EngineConfig
    from specchat.engine.engine import Engine
    from tests.conftest import save_tiny_hf

    path = save_tiny_hf(tiny_model_dir.parent / "tied", {"tie_word_embeddings": True})
    for f in tiny_model_dir.glob("tokenizer*"):
        (path / f.name).write_bytes(f.read_bytes())
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    model = engine.model
    embed = model.embed.weight.clone()
    swap_modules(model, fp4_modules(model, round_to_nearest(model, ["lm_head"])))
    assert isinstance(model.lm_head, Fp4Linear) and torch.equal(model.embed.weight, embed)
