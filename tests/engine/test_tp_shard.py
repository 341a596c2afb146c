"""The slices of engine.tp.shard, in one process: each sharded layer, combined as its collective would combine it
(concatenated for column-parallel, summed for row-parallel), equals the unsharded layer, dense and MXFP4; the
checks on the shapes end in one line."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.model import ModelConfig
from specchat.engine.tp.shard import (
    check_mxfp4_tp,
    check_tp,
    kv_heads_of,
    linear_slices,
    rank_config,
    shard_dense,
    shard_mxfp4,
    shard_state,
    vocab_rows,
)
from specchat.errors import ConfigError
from specchat.kernels.mxfp4 import quantize_mxfp4
from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear, rotate_blocks


def config(heads: int = 8, kv_heads: int = 2, head_dim: int = 16, units: int = 128, vocab: int = 101) -> ModelConfig:
    return ModelConfig("llama", vocab, 64, units, 2, heads, kv_heads, head_dim)


def split_qkv(out: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, q + 2 kv] -> q [T, H, D], k and v [T, KVH, D] of a config (full or one rank's)."""
    q, k, v = out.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    t, d = out.shape[0], cfg.head_dim
    return q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 4 and 8 > 2 KV heads: each KV head replicated on tp / 2 ranks
def test_wqkv_column_parallel_gives_each_rank_its_heads_and_their_kv_heads(tp):
    cfg = config()
    torch.manual_seed(0)
    w = torch.randn(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    bias = torch.randn(w.shape[0])
    x = torch.randn(5, cfg.hidden_size)
    q, k, v = split_qkv(x @ w.T + bias, cfg)
    local = rank_config(cfg, tp)
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    for rank in range(tp):
        s = linear_slices(cfg, rank, tp)["attn.wqkv"]
        q_r, k_r, v_r = split_qkv(x @ shard_dense(w, s).T + shard_dense(bias[:, None], s)[:, 0], local)
        heads = range(rank * local.num_heads, (rank + 1) * local.num_heads)
        kv = kv_heads_of(cfg, rank, tp)
        torch.testing.assert_close(q_r, q[:, heads.start : heads.stop])
        torch.testing.assert_close(k_r, k[:, kv.start : kv.stop])
        torch.testing.assert_close(v_r, v[:, kv.start : kv.stop])
        assert {h // group for h in heads} <= set(kv), "a rank's query heads read only the KV heads it holds"


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_and_attention_output_split_sum_to_the_unsharded_products(tp):
    cfg = config()
    torch.manual_seed(1)
    gate_up = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size)
    down = torch.randn(cfg.hidden_size, cfg.intermediate_size)
    wo = torch.randn(cfg.hidden_size, cfg.q_size)
    x = torch.randn(3, cfg.hidden_size)
    attn_out = torch.randn(3, cfg.q_size)

    def mlp(x, gu, d):
        gate, up = (x @ gu.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ d.T

    partial_mlp, partial_o = [], []
    for rank in range(tp):
        s = linear_slices(cfg, rank, tp)
        partial_mlp.append(mlp(x, shard_dense(gate_up, s["mlp.w_gate_up"]), shard_dense(down, s["mlp.w_down"])))
        lo, hi = s["attn.wo"].cols
        partial_o.append(attn_out[:, lo:hi] @ shard_dense(wo, s["attn.wo"]).T)
    torch.testing.assert_close(sum(partial_mlp), mlp(x, gate_up, down), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sum(partial_o), attn_out @ wo.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tp", [2, 3])  # 101 rows: padded to 102 and to 102
def test_vocab_parallel_head_gathers_to_the_unsharded_logits(tp):
    cfg = config(vocab=101)
    torch.manual_seed(2)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    x = torch.randn(4, cfg.hidden_size)
    parts = [x @ shard_dense(head, linear_slices(cfg, r, tp)["lm_head"]).T for r in range(tp)]
    assert all(p.shape == (4, vocab_rows(cfg, tp)) for p in parts)
    torch.testing.assert_close(torch.cat(parts, dim=-1)[:, : cfg.vocab_size], x @ head.T)


def test_a_tied_head_is_cut_from_the_embedding():
    cfg = config()
    cfg.tie_embeddings = True
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    for rank in range(2):
        head = shard_state({"embed.weight": embed}, cfg, rank, 2)["lm_head.weight"]
        lo = rank * vocab_rows(cfg, 2)
        torch.testing.assert_close(head[: cfg.vocab_size - lo], embed[lo : lo + vocab_rows(cfg, 2)])


@pytest.mark.parametrize("rotated", [False, True])
def test_mxfp4_slices_on_whole_blocks_equal_the_unsharded_fp4_layers(rotated):
    """Column-parallel rows and row-parallel block-aligned columns of packed MXFP4 (plain and W R rotated)."""
    cfg = config(units=128)
    tp = 2
    cls = RotatedFp4Linear if rotated else Fp4Linear
    torch.manual_seed(3)
    gate_up = torch.randn(2 * cfg.intermediate_size, cfg.hidden_size)
    down = torch.randn(cfg.hidden_size, cfg.intermediate_size)

    def fp4(w, s=None):
        codes, scales = quantize_mxfp4(rotate_blocks(w) if rotated else w, rule="mse")
        if s is not None:
            codes, scales = shard_mxfp4(codes, scales, s)
        k = w.shape[1] if s is None or s.cols is None else s.cols[1] - s.cols[0]
        return cls.from_packed(codes, scales, k)

    x = torch.randn(3, cfg.hidden_size)
    h = torch.randn(3, cfg.intermediate_size)
    full_gu, full_down = fp4(gate_up)(x), fp4(down)(h)
    partial = []
    for rank in range(tp):
        s = linear_slices(cfg, rank, tp)
        gate, up = fp4(gate_up, s["mlp.w_gate_up"])(x).chunk(2, dim=-1)
        units = slice(rank * cfg.intermediate_size // tp, (rank + 1) * cfg.intermediate_size // tp)
        torch.testing.assert_close(gate, full_gu[:, units], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(up, full_gu[:, cfg.intermediate_size :][:, units], rtol=1e-5, atol=1e-5)
        lo, hi = s["mlp.w_down"].cols
        partial.append(fp4(down, s["mlp.w_down"])(h[:, lo:hi]))
    torch.testing.assert_close(sum(partial), full_down, rtol=1e-5, atol=1e-4)


def test_round_to_nearest_of_a_slice_is_the_slice_of_round_to_nearest():
    """Why --tp may quantize each rank's dense slice itself (engine.tp.load)."""
    cfg = config()
    w = torch.randn(cfg.hidden_size, cfg.intermediate_size)
    codes, scales = quantize_mxfp4(w, rule="mse")
    for rank in range(2):
        s = linear_slices(cfg, rank, 2)["mlp.w_down"]
        mine = quantize_mxfp4(shard_dense(w, s), rule="mse")
        for a, b in zip(mine, shard_mxfp4(codes, scales, s), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("cfg", "tp", "message"),
    [
        (config(heads=9, kv_heads=3), 2, "--tp 2: the model's 9 attention heads do not divide into 2 ranks"),
        (config(heads=12, kv_heads=3), 2, "--tp 2: the model's 3 KV heads neither divide into 2 ranks nor divide 2"),
        (config(heads=8, kv_heads=8, units=100), 8, "--tp 8: the MLP's 100 units do not divide into 8 ranks"),
        (config(), 0, "--tp must be >= 1, got 0"),
    ],
)
def test_shapes_that_do_not_split_end_in_one_line(cfg, tp, message):
    with pytest.raises(ConfigError) as err:
        check_tp(cfg, tp)
    assert str(err.value) == message


def test_mxfp4_refuses_a_row_parallel_slice_that_cuts_a_block():
    cfg = config(units=96)  # 48 units per rank: a block and a half
    check_tp(cfg, 2)
    with pytest.raises(ConfigError, match="MLP down projection's 96 inputs split into 48 per rank"):
        check_mxfp4_tp(cfg, 2)
