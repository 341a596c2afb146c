"""One rank's model: the checkpoint read, its slices cut (engine.tp.shard), the rank's modules built, the weight
format applied to the slices.

Every rank reads the same checkpoint and keeps only its slices; no rank ever holds the whole model on its device.
The weight format is settled at load and kept: the live bf16 <-> MXFP4 switch (quant.handler) would change every
rank's modules at once and is not offered with --tp. `--weights mxfp4` takes, in order, the MXFP4 checkpoint the
model was loaded from, the model's cached GPTQ checkpoint (`specchat quantize` makes it), else round to nearest
over the block linears; each is sliced along whole 32-element blocks. Round to nearest works per block, so a slice
of its result is exactly the result on the slice. GPTQ is not run here: its error feedback runs along a whole row.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specchat.engine.loader import Progress, load_checkpoint
from specchat.engine.model import Linear, ModelConfig, RotaryEmbedding, Transformer, skeleton
from specchat.engine.tp.shard import rank_config, shard_packed, shard_state, vocab_rows
from specchat.errors import ModelFormatError
from specchat.quant.checkpoint import (
    cache_dir,
    checkpoint_metadata,
    describe,
    is_mxfp4_checkpoint,
    read_packed,
    take_packed,
)
from specchat.quant.handler import FALLBACK_LAYERS, FALLBACK_RULE
from specchat.quant.modules import Packed, dense_modules, fp4_modules, round_to_nearest, select_linears, swap_modules
from specchat.registry import derived_dir


@dataclass(slots=True)
class RankModel:
    """A rank's shard, before `parallelize` joins it to the others, and how its linear weights are held."""

    model: Transformer
    full_config: ModelConfig  # the unsharded model's shape
    weights_format: str  # "bf16" (the model dtype) | "mxfp4"
    weights_method: str | None  # how the MXFP4 weights were made


def read_checkpoint(path: Path, progress: Progress | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state in our names) as engine.loading reads them (a GGUF's converted weights cached beside it)."""
    cache = derived_dir(path) / "weights.safetensors" if path.is_file() else None
    return load_checkpoint(path, progress=progress, cache=cache)


def build_rank_model(
    cfg: ModelConfig, state: dict[str, torch.Tensor], head_rows: int, dtype: torch.dtype, device: torch.device
) -> Transformer:
    """The rank's Transformer (shape `cfg` = rank_config's) from its sliced state, the head `head_rows` rows."""
    model = skeleton(cfg)
    with torch.device("meta"):
        model.lm_head = Linear(cfg.hidden_size, head_rows, bias=False)
    expected = model.state_dict()
    for name, ref in expected.items():
        got = state.get(name)
        if got is None:
            raise ModelFormatError(f"checkpoint lacks {name}")
        if tuple(got.shape) != tuple(ref.shape):
            raise ModelFormatError(f"tensor {name} sliced to {tuple(got.shape)}, the rank expects {tuple(ref.shape)}")
    model.load_state_dict({n: state[n].to(device=device, dtype=dtype) for n in expected}, assign=True, strict=True)
    model.rope = RotaryEmbedding(cfg).to(device)  # non-persistent buffers were left on meta
    return model.eval().requires_grad_(False)


def apply_weights(
    model: Transformer,
    cfg: ModelConfig,
    rank: int,
    tp: int,
    packed: Packed,
    meta: dict | None,
    path: Path,
    requested: str,
) -> tuple[str, str | None]:
    """Install the rank's MXFP4 slices as the module docstring says; returns (format, method)."""
    if packed:
        swap_modules(model, fp4_modules(model, shard_packed(packed, cfg, rank, tp), meta["rotation"] is not None))
        if requested == "bf16":  # an MXFP4 checkpoint has no dense weights: their dequantized values
            swap_modules(model, dense_modules(model, next(model.parameters()).dtype))
            return "bf16", None
        return "mxfp4", describe(meta)
    if requested != "mxfp4":
        return "bf16", None
    cache = cache_dir(path)
    if is_mxfp4_checkpoint(cache):
        packed, meta = read_packed(cache)
        rotated = meta["rotation"] is not None
        swap_modules(model, fp4_modules(model, shard_packed(packed, cfg, rank, tp), rotated))
        return "mxfp4", f"{describe(meta)} (cached)"
    shard_packed({}, cfg, rank, tp)  # the shape check: row-parallel slices fall on whole blocks
    names = select_linears(model, FALLBACK_LAYERS)
    swap_modules(model, fp4_modules(model, round_to_nearest(model, names, FALLBACK_RULE)))
    return "mxfp4", describe({"method": "rtn", "rule": FALLBACK_RULE})


def load_rank(
    path: Path,
    rank: int,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    weights: str,
    checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
) -> RankModel:
    """Rank `rank` of `tp`: its shard of the model at `path` on `device` (`checkpoint`: already read, if it was)."""
    cfg, state = checkpoint or read_checkpoint(path)
    state = dict(state)  # take_packed removes the MXFP4 entries from the dict it is given
    packed = take_packed(state)
    rank_state = shard_state(state, cfg, rank, tp)
    model = build_rank_model(rank_config(cfg, tp), rank_state, vocab_rows(cfg, tp), dtype, device)
    del rank_state
    meta = checkpoint_metadata(path)
    fmt, method = apply_weights(model, cfg, rank, tp, packed, meta, path, weights)
    return RankModel(model, cfg, fmt, method)
