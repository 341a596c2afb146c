"""MXFP4 checkpoints: what `specchat quantize` writes and `specchat generate DIR` loads.

A checkpoint is a directory:

    config.json            the model's shape, HF style (read by engine.loader.hf_config)
    model.safetensors      our parameter names (engine/model.py): dense tensors as `name`, each MXFP4 linear as
                           `name.codes` (uint8 [N, Kp/2], element 2j in the low nibble) and `name.scales`
                           (uint8 [N, Kp/32], E8M0), the interchange layout of kernels.mxfp4 (OCP MX v1.0)
    specchat_mxfp4.json    metadata: format version, method (rtn | gptq) and its settings, rounding rule, rotation
                           (null, or "hadamard32": the codes encode W R, see quant.fp4_linear), layer
                           selection, the quantized modules with their [out, in] shapes, source model,
                           calibration text
    tokenizer files        copied from the source model

Loading is bit-exact: the stored codes and scales become the Fp4Linear buffers unchanged (laid out for the
device). `read_mxfp4_state` returns a state dict that `engine.loader.build_model` accepts (each MXFP4
weight dequantized under its dense name) plus the packed entries, which `take_packed` removes for
`quant.handler` to install; the dense copies live only until the Fp4Linear modules replace them. The engine
reads config.json itself (engine.loader.load_mxfp4_dir): this package does not import the engine.

The live toggle's MXFP4 weights for a model come from `cache_dir(model_path)`, a checkpoint under the model's
derived folder ($SPECCHAT_HOME/derived/, registry.derived_dir) that `specchat quantize` writes by default and the
toggle writes itself the first time it needs it (quant.handler).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specchat.errors import ModelFormatError
from specchat.kernels.mxfp4 import dequantize_mxfp4
from specchat.quant.fp4_linear import rotate_blocks
from specchat.registry import derived_dir
from specchat.safetensors_io import read_safetensors, save_tensors

if TYPE_CHECKING:  # annotations only: the engine imports this package, never the other way round
    from specchat.engine.model import ModelConfig

METADATA_FILE = "specchat_mxfp4.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "specchat-mxfp4"
FORMAT_VERSION = 1
CODES, SCALES = ".codes", ".scales"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
CACHE_NAME = "mxfp4"  # the toggle's checkpoint, in the model's derived folder
ROTATIONS = (None, "hadamard32")  # None: codes encode W; "hadamard32": W R (quant.fp4_linear.RotatedFp4Linear)

Packed = dict[str, tuple[torch.Tensor, torch.Tensor]]
Progress = Callable[[str, int, int], None]


def is_mxfp4_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILE).is_file()


def cache_dir(model_path: Path) -> Path:
    """Where MODEL's MXFP4 checkpoint for the live toggle lives: its derived folder, keyed by the model file."""
    return derived_dir(model_path) / CACHE_NAME


def hf_config_dict(cfg: ModelConfig) -> dict:
    """ModelConfig -> the config.json keys engine.loader.hf_config reads back into the same ModelConfig."""
    config = {
        "model_type": cfg.arch,  # one of config.HF_ARCHITECTURES
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
    }
    if cfg.rope_scaling:
        config["rope_scaling"] = cfg.rope_scaling
    return config


def save_mxfp4_checkpoint(
    out: Path, model: torch.nn.Module, packed: Packed, tokenizer_dir: Path, metadata: dict
) -> None:
    """Write `model` (dense) with the linears in `packed` stored as MXFP4 codes and scales."""
    out.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = model.cfg
    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for name, module in model.named_modules():
        # A linear that reads only its GGUF blocks (CPU int8 rows) has released its float weight, so state_dict()
        # lacks it: `.weight` makes it from the blocks. Without this a checkpoint of some linears (`--layers
        # all,-layers.0.*` of a GGUF model) lacked the others' weights and did not load.
        if isinstance(module, torch.nn.Linear) and name not in packed and f"{name}.weight" not in state:
            state[f"{name}.weight"] = module.weight
    for name, tensor in state.items():
        module = name.rpartition(".")[0]
        if module in packed or (cfg.tie_embeddings and name == "lm_head.weight"):
            continue  # stored packed, or the tied head (the embedding holds it)
        tensors[name] = tensor.detach().cpu().contiguous()
    for name, (codes, scales) in packed.items():
        tensors[name + CODES] = codes.cpu().contiguous()
        tensors[name + SCALES] = scales.cpu().contiguous()
    save_tensors(tensors, out / WEIGHTS_FILE, metadata={"format": "pt", "specchat": FORMAT})
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    shapes = {name: list(model.get_submodule(name).weight.shape) for name in sorted(packed)}  # [out, in]
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "rotation": None, **metadata, "quantized": shapes}
    (out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)


def read_metadata(path: Path) -> dict:
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ModelFormatError(f"{path / METADATA_FILE}: invalid JSON ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ModelFormatError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} checkpoint")
    if meta.get("rotation") not in ROTATIONS:
        raise ModelFormatError(f"{path}: unknown rotation {meta.get('rotation')!r} (known: {ROTATIONS})")
    return meta


def _read_tensors(path: Path, names: Callable[[str], bool] = lambda _: True) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ModelFormatError(f"{path}: missing {WEIGHTS_FILE}")
    return read_safetensors(file, names)


def read_mxfp4_state(path: Path, progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """An MXFP4 checkpoint's tensors: a state dict with dense stand-ins plus the packed `.codes`/`.scales`.

    A tied output head is left out (config.json says whether the head is tied; the engine's loader reads it).
    """
    meta = read_metadata(path)
    state = _read_tensors(path)
    for name in meta["quantized"]:
        codes, scales = state.get(name + CODES), state.get(name + SCALES)
        if codes is None or scales is None:
            raise ModelFormatError(f"{path}: metadata names {name} but {WEIGHTS_FILE} lacks its codes or scales")
        _, in_features = meta["quantized"][name]
        values = dequantize_mxfp4(codes, scales, torch.float32, k=in_features)  # of W R if rotated
        state[name + ".weight"] = rotate_blocks(values) if meta["rotation"] else values
    if progress:
        progress("loading weights", 1, 1)
    return state


def checkpoint_metadata(path: Path) -> dict | None:
    """The metadata of an MXFP4 checkpoint; None for any other model."""
    return read_metadata(path) if is_mxfp4_checkpoint(path) else None


def describe(meta: dict) -> str:
    """How MXFP4 weights were made, in one word: "gptq", "gptq-rot", "rtn-mse", "rtn-mse-rot"."""
    name = meta["method"] if meta["method"] != "rtn" else f"rtn-{meta['rule']}"
    return name + ("-rot" if meta.get("rotation") else "")


def take_packed(state: dict[str, torch.Tensor]) -> Packed:
    """Remove and return the MXFP4 entries of a loaded state dict: {module name: (codes, scales)}."""
    names = [key.removesuffix(CODES) for key in state if key.endswith(CODES)]
    return {name: (state.pop(name + CODES), state.pop(name + SCALES)) for name in names}


def read_packed(path: Path) -> tuple[Packed, dict]:
    """Only the MXFP4 linears of a checkpoint (the live toggle's cached weights) and its metadata."""
    meta = read_metadata(path)
    state = _read_tensors(path, lambda name: name.endswith((CODES, SCALES)))
    return take_packed(state), meta
