"""The dequantized weights of a GGUF file, saved in its derived folder (registry.derived_dir) so that later loads
skip parsing and dequantizing: float32 tensors in our parameter names, the ModelConfig in the file's metadata.

A cache must never be what stops a model from loading (issue 19): the file is written beside its final name,
synced and renamed into place, so it is whole or absent; reading it back checks the header, the config and every
tensor's shape against that config, and any damage is a ModelFormatError that engine.loader.load_gguf answers by
rebuilding the file from the GGUF.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from specchat.engine.model import ModelConfig, skeleton
from specchat.errors import ModelFormatError, note_not_saved
from specchat.safetensors_io import read_safetensors

STALE_PARTIAL_S = 600  # a partial cache file this old belongs to a write that was killed

log = logging.getLogger(__name__)


def write_converted(cache: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> None:
    """Save dequantized weights for later loads. They go to a partial file of this process's own, synced to disk,
    then renamed into place, so a crash, a power cut or a second process never leaves half a file under the
    cache's name. Failing to write only costs the next load its speed: a note, not an error."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {k: v for k, v in sd.items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    partial: Path | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".part")
        os.close(fd)
        partial = Path(name)
        save_file(tensors, name, metadata={"config": json.dumps(dataclasses.asdict(cfg))})
        with partial.open("rb+") as f:
            os.fsync(f.fileno())
        partial.replace(cache)
    except (OSError, SafetensorError) as exc:
        note_not_saved(log, cache, exc)
        if partial is not None:
            partial.unlink(missing_ok=True)
        return
    _remove_stale_partials(cache)


def _remove_stale_partials(cache: Path) -> None:
    """Partial files of writes that were killed (a process's own partial is younger than STALE_PARTIAL_S)."""
    now = time.time()
    for old in [*cache.parent.glob(f".{cache.name}.*.part"), cache.with_suffix(".part")]:
        try:
            if now - old.stat().st_mtime > STALE_PARTIAL_S:
                old.unlink()
        except OSError:  # gone already, or not ours to remove
            continue


def read_converted(cache: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The weights write_converted saved; ModelFormatError naming the file if it is damaged in any way that
    would stop the model from loading."""
    from safetensors import safe_open

    sd = read_safetensors(cache)  # a truncated file or a corrupt header: ModelFormatError
    try:
        with safe_open(str(cache), framework="pt") as f:
            fields = json.loads((f.metadata() or {})["config"])
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        cfg = ModelConfig(**fields)
        expected = skeleton(cfg).state_dict()
    except Exception as exc:  # a missing or edited config: KeyError, TypeError, ValueError, from json or torch
        raise ModelFormatError(f"{cache}: no usable model config ({type(exc).__name__}: {exc})") from None
    if cfg.tie_embeddings and "embed.weight" in sd:
        sd["lm_head.weight"] = sd["embed.weight"]
    for name, ref in expected.items():
        if name not in sd:
            raise ModelFormatError(f"{cache}: tensor {name} is missing")
        if sd[name].shape != ref.shape:
            shape, implied = tuple(sd[name].shape), tuple(ref.shape)
            raise ModelFormatError(f"{cache}: tensor {name} has shape {shape}, its config implies {implied}")
    return cfg, sd
