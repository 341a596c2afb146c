"""Which slice of each weight a rank holds (Megatron-LM's split, Shoeybi et al. 2019), for dense and MXFP4 tensors.

A block's two products are split so that each needs one collective: the first linear of each pair is
*column-parallel* (rank r holds some of its output rows and computes those outputs from the whole input), the
second is *row-parallel* (rank r holds the matching input columns, computes a partial sum, and an all-reduce adds
the ranks' partial sums):

    attention: wqkv column-parallel by heads  ->  attention over the rank's heads  ->  wo row-parallel (all-reduce)
    MLP:       w_gate_up column-parallel      ->  silu(gate) * up on the rank's units ->  w_down row-parallel (all-reduce)
    output:    lm_head column-parallel by vocabulary rows (vocab-parallel), logits all-gathered

Fused layouts: wqkv's rows are [q (H*D) | k (KVH*D) | v (KVH*D)], so rank r takes its query heads from q and its
KV heads from k and from v; w_gate_up's rows are [gate (I) | up (I)], so rank r takes its units from each half.
When a model has fewer KV heads than ranks (KVH < N, N a multiple of KVH), each KV head is *replicated* on the
N / KVH ranks whose query heads read it. The vocabulary is padded to a multiple of N with zero rows, cut off after
the all-gather. Embedding and norms are replicated.

MXFP4 (kernels.mxfp4): a weight is codes [rows, K/2] (two E2M1 per byte) and scales [rows, K/32] (one E8M0 per
block of 32 inputs). Taking output rows keeps every block whole; a row-parallel slice of the input columns must
start and end on a block boundary, which `check_tp` asks of the shapes (K/N a multiple of 32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specchat.engine.model import ModelConfig
from specchat.errors import ConfigError
from specchat.kernels.mxfp4 import BLOCK_SIZE

PAD_SCALE = 127  # E8M0 code of 2^0: padded vocabulary rows of an MXFP4 head dequantize to exact zeros


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """ConfigError (one line) if `cfg` cannot be split over `tp` ranks."""
    where = f"--tp {tp}"
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    if cfg.num_heads % tp:
        raise ConfigError(f"{where}: the model's {cfg.num_heads} attention heads do not divide into {tp} ranks")
    kvh = cfg.num_kv_heads
    if (kvh >= tp and kvh % tp) or (kvh < tp and tp % kvh):
        raise ConfigError(f"{where}: the model's {kvh} KV heads neither divide into {tp} ranks nor divide {tp}")
    if cfg.intermediate_size % tp:
        raise ConfigError(f"{where}: the MLP's {cfg.intermediate_size} units do not divide into {tp} ranks")


def check_mxfp4_tp(cfg: ModelConfig, tp: int) -> None:
    """ConfigError if a row-parallel MXFP4 slice would cut a 32-element block."""
    for what, k in (("attention output", cfg.q_size), ("MLP down", cfg.intermediate_size)):
        if (k // tp) % BLOCK_SIZE:
            raise ConfigError(
                f"--tp {tp} with MXFP4 weights: the {what} projection's {k} inputs split into {k // tp} per rank, "
                f"not whole {BLOCK_SIZE}-element blocks"
            )


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape one rank's model is built with: its heads, KV heads and MLP units; the vocabulary stays whole
    (the embedding is replicated; the output head is swapped for a vocab-parallel one), and the head is untied
    (each rank keeps the whole embedding but only its rows of the head)."""
    check_tp(cfg, tp)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=max(cfg.num_kv_heads // tp, 1),
        intermediate_size=cfg.intermediate_size // tp,
        tie_embeddings=False,
    )


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    """Output-head rows per rank: the vocabulary padded up to a multiple of tp, divided."""
    return -(-cfg.vocab_size // tp)


@dataclass(frozen=True, slots=True)
class Slice:
    """One rank's part of a linear [out, in]: these row ranges, concatenated, then `pad_rows` zero rows; the input
    columns [cols[0], cols[1]) (None: all of them)."""

    rows: tuple[tuple[int, int], ...] | None = None  # None: all rows
    cols: tuple[int, int] | None = None
    pad_rows: int = 0


def kv_heads_of(cfg: ModelConfig, rank: int, tp: int) -> range:
    """The KV heads rank `rank` holds (one replicated head when the model has fewer KV heads than ranks)."""
    if cfg.num_kv_heads >= tp:
        per = cfg.num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // cfg.num_kv_heads)
    return range(head, head + 1)


def linear_slices(cfg: ModelConfig, rank: int, tp: int) -> dict[str, Slice]:
    """Module-name suffix -> the rank's Slice, for every sharded linear of a block and for the head."""
    d, q = cfg.head_dim, cfg.q_size
    heads = cfg.num_heads // tp
    kv = kv_heads_of(cfg, rank, tp)
    q_rows = (rank * heads * d, (rank + 1) * heads * d)
    k_rows = (q + kv.start * d, q + kv.stop * d)
    v_rows = (q + cfg.kv_size + kv.start * d, q + cfg.kv_size + kv.stop * d)
    units = cfg.intermediate_size // tp
    gate = (rank * units, (rank + 1) * units)
    up = (cfg.intermediate_size + gate[0], cfg.intermediate_size + gate[1])
    per = vocab_rows(cfg, tp)
    vocab = (min(rank * per, cfg.vocab_size), min((rank + 1) * per, cfg.vocab_size))
    return {
        "attn.wqkv": Slice(rows=(q_rows, k_rows, v_rows)),
        "attn.wo": Slice(cols=q_rows),
        "mlp.w_gate_up": Slice(rows=(gate, up)),
        "mlp.w_down": Slice(cols=gate),
        "lm_head": Slice(rows=(vocab,), pad_rows=per - (vocab[1] - vocab[0])),
    }


def slice_for(name: str, slices: dict[str, Slice]) -> Slice | None:
    """The Slice of a module name ("layers.3.attn.wqkv", "lm_head"), or None for a replicated module."""
    return next((s for suffix, s in slices.items() if name == suffix or name.endswith("." + suffix)), None)


def take_rows(t: torch.Tensor, s: Slice, pad_value: int = 0) -> torch.Tensor:
    """The rows of `t` [out, ...] that Slice `s` keeps (a bias as well as a weight or its MXFP4 codes/scales)."""
    if s.rows is not None:
        parts = [t[a:b] for a, b in s.rows]
        t = parts[0] if len(parts) == 1 else torch.cat(parts)
    if s.pad_rows:
        t = torch.cat([t, t.new_full((s.pad_rows, *t.shape[1:]), pad_value)])
    return t


def shard_dense(weight: torch.Tensor, s: Slice) -> torch.Tensor:
    """A dense weight [out, in] -> the rank's [out_r, in_r] (contiguous, its own storage)."""
    w = take_rows(weight, s)
    if s.cols is not None:
        w = w[:, s.cols[0] : s.cols[1]]
    return w.clone(memory_format=torch.contiguous_format)  # a copy: a view would keep the whole tensor alive


def shard_mxfp4(codes: torch.Tensor, scales: torch.Tensor, s: Slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Interchange codes uint8 [out, K/2] and scales uint8 [out, K/32] -> the rank's, cut along whole blocks."""
    codes, scales = take_rows(codes, s), take_rows(scales, s, PAD_SCALE)
    if s.cols is not None:
        lo, hi = s.cols
        if lo % BLOCK_SIZE or hi % BLOCK_SIZE:
            raise ConfigError(f"an MXFP4 slice of inputs [{lo}, {hi}) does not fall on {BLOCK_SIZE}-element blocks")
        codes = codes[:, lo // 2 : hi // 2]
        scales = scales[:, lo // BLOCK_SIZE : hi // BLOCK_SIZE]
    return codes.clone(memory_format=torch.contiguous_format), scales.clone(memory_format=torch.contiguous_format)


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """A loaded state dict in our names -> the rank's (weights and biases sliced; everything else as is).

    A tied model's head is the embedding's matrix: the rank's head rows are cut from it.
    """
    slices = linear_slices(cfg, rank, tp)
    out = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        s = slice_for(module, slices)
        if s is None:
            out[name] = tensor
        elif kind == "bias":
            out[name] = take_rows(tensor, s).clone()
        else:
            out[name] = shard_dense(tensor, s)
    if cfg.tie_embeddings and "lm_head.weight" not in state:
        out["lm_head.weight"] = shard_dense(state["embed.weight"], slices["lm_head"])
    return out


def shard_packed(
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig, rank: int, tp: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """MXFP4 linears {module name: (codes, scales)} -> the rank's slices of each."""
    check_mxfp4_tp(cfg, tp)
    slices = linear_slices(cfg, rank, tp)
    out = {}
    for name, (codes, scales) in packed.items():
        s = slice_for(name, slices)
        out[name] = (codes, scales) if s is None else shard_mxfp4(codes, scales, s)
    return out
