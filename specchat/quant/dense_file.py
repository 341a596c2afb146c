"""The dense weights a switched-away model no longer holds, on disk: where the weight switch reads them back from.

A dense file is a safetensors file in our parameter names (engine/model.py): the GGUF's converted weights that
the engine's loader caches in the model's derived folder (float32), or `dense-<dtype>.safetensors` there, which
the switch writes the first time it drops tensors that no file holds in our names (an HF directory, whose
q/k/v and gate/up are separate tensors; a GGUF too large for the converted cache). Reading goes tensor by tensor
through safetensors, which maps the file: switching back costs the tensors it restores, never a second copy of
the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specchat.errors import ModelFormatError
from specchat.registry import derived_dir
from specchat.safetensors_io import save_tensors


def dense_cache_file(model_path: Path, dtype: torch.dtype) -> Path:
    """The switch's own dense file for a model, in the dtype it was loaded in (so that restoring is exact)."""
    return derived_dir(model_path) / f"dense-{str(dtype).removeprefix('torch.')}.safetensors"


def holds(path: Path | None, names: list[str]) -> bool:
    """Whether `path` is a safetensors file holding every tensor in `names`."""
    if path is None or not path.is_file():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return set(names) <= set(f.keys())
    except Exception:  # a damaged file holds nothing we can use; it is rewritten
        return False


def read_dense(path: Path, names: list[str], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Tensors `names` of a dense file, one at a time, in `dtype` on `device`."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name).to(device=device, dtype=dtype) for name in names}
    except Exception as exc:  # the file changed under us since it was checked
        raise ModelFormatError(f"{path}: cannot read the dense weights back ({exc})") from None


def write_dense(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write tensors (from host memory or a GPU) to `path`, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    save_tensors({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, partial)
    partial.replace(path)
