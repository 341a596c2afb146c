"""Quantization as a transform: swap a model's nn.Linear modules for Fp4Linear ones and back.

The model's code never asks whether it is quantized (docs/style.md #6, after gpt-fast's quantize.py): which
modules sit in `model.layers[i].attn.wqkv` and friends decides it. This file picks the modules (a layer
selection), builds their MXFP4 form (round to nearest, or packed weights from a GPTQ checkpoint) and swaps them.

Layer selection: a comma-separated list of terms applied in order. A term is `blocks` (every linear inside the
transformer blocks: attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down), `lm_head`, `all` (both), or an fnmatch
pattern over module names (`layers.*.mlp.w_down`); a leading `-` removes what the term matches. The default,
`blocks`, keeps the output head in the model dtype: with tied embeddings (the default model) the head shares
its matrix with the token embedding, which must stay dense for lookups, so quantizing the head adds an MXFP4
copy instead of replacing one, and it costs the most quality per byte (docs/benchmarks.md).

`WeightSwitch` is the live toggle's state: which form the linears are in, and the form the model was loaded in,
kept (in host memory on a GPU) while the other form runs, so that switching back restores it exactly.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specchat.config import WEIGHT_FORMATS
from specchat.kernels.mxfp4 import Rule, quantize_mxfp4
from specchat.quant.checkpoint import cache_dir, describe, is_mxfp4_checkpoint, read_packed
from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear, rotate_blocks

DEFAULT_LAYERS = "blocks"
DEFAULT_RULE: Rule = "mse"  # the toggle's round-to-nearest fallback (docs/benchmarks.md: mse < roundup < ocp)
DEFAULT_ROTATE = False  # the block rotation helps GPTQ a lot but hurts round to nearest (docs/benchmarks.md)
ROTATION = "hadamard32"
LINEAR_TYPES = (nn.Linear, Fp4Linear)
BLOCK_LINEARS = "layers.*"
HOST = torch.device("cpu")

Packed = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module name -> interchange (codes, scales)


def linear_names(model: nn.Module) -> list[str]:
    """Names of every linear module (dense or MXFP4), in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, LINEAR_TYPES)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (packed MXFP4 weights are buffers), shared storage once."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total


def select_linears(model: nn.Module, layers: str = DEFAULT_LAYERS) -> list[str]:
    """Module names chosen by a layer selection (see the module docstring), in module order."""
    names = linear_names(model)
    chosen: set[str] = set()
    for raw in layers.split(","):
        term = raw.strip()
        if not term:
            continue
        remove = term.startswith("-")
        term = term.removeprefix("-")
        patterns = {"blocks": [BLOCK_LINEARS], "all": [BLOCK_LINEARS, "lm_head"]}.get(term, [term])
        matched = {n for n in names for p in patterns if fnmatch.fnmatchcase(n, p)}
        if not matched:
            raise ValueError(f"layer selection term {raw.strip()!r} matches no linear module")
        chosen = chosen - matched if remove else chosen | matched
    return [n for n in names if n in chosen]


def swap_modules(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Put each module at its name in `model`; returns the modules that were there."""
    replaced = {}
    for name, module in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replaced[name] = getattr(parent, child)
        setattr(parent, child, module)
    return replaced


def round_to_nearest(model: nn.Module, names: Sequence[str], rule: Rule = DEFAULT_RULE, rotate: bool = False) -> Packed:
    """MXFP4 codes and scales of the named dense linears (of W R if `rotate`), block scales by `rule`, RNE."""
    packed = {}
    for name in names:
        weight = model.get_submodule(name).weight.detach()
        packed[name] = quantize_mxfp4(rotate_blocks(weight) if rotate else weight, rule=rule)
    return packed


def fp4_modules(model: nn.Module, packed: Packed, rotated: bool = False) -> dict[str, Fp4Linear]:
    """Fp4Linear modules (RotatedFp4Linear if the packed weights are W R) for the named linears of `model`, on
    its device, biases copied from the dense ones."""
    device = next(model.parameters()).device
    cls = RotatedFp4Linear if rotated else Fp4Linear
    modules = {}
    for name, (codes, scales) in packed.items():
        dense = model.get_submodule(name)
        bias = None if dense.bias is None else dense.bias.detach().clone()
        modules[name] = cls.from_packed(codes.to(device), scales.to(device), dense.in_features, bias)
    return modules


def dense_modules(model: nn.Module, dtype: torch.dtype) -> dict[str, nn.Linear]:
    """Dense nn.Linear modules (dequantized weights in `dtype`) for every Fp4Linear of `model`."""
    return {name: m.to_linear(dtype) for name, m in model.named_modules() if isinstance(m, Fp4Linear)}


def packed_state(model: nn.Module) -> Packed:
    """The interchange (codes, scales) of every Fp4Linear of `model`."""
    return {name: m.packed() for name, m in model.named_modules() if isinstance(m, Fp4Linear)}


def module_bytes(modules: dict[str, nn.Module], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the modules' parameters and buffers, each storage once, minus storages shared with `exclude`."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0
    for module in modules.values():
        for t in (*module.parameters(), *module.buffers()):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total


@dataclass
class WeightSwitch:
    """Live bf16 <-> MXFP4 toggle of a model's linear weights.

    Switching away from `home` builds the other form with `build_other` and keeps the home modules in `stash`:
    in host memory when the model is on a GPU (moved back on the way home), in place on the CPU. Switching back
    restores the stash exactly and drops the built form. The memory cost of being switched away is the home
    form's linears once more, in host memory (`stash_bytes`); at home it is nothing.
    """

    model: nn.Module
    home: str  # "bf16" | "mxfp4": the form the model was loaded in, kept while the other one runs
    home_method: str | None  # how the home MXFP4 weights were made (None for bf16)
    build_other: Callable[[], tuple[dict[str, nn.Module], str | None]]  # -> (modules, method)
    current: str = ""  # the form running now; "" = home
    method: str | None = None
    stash: dict[str, nn.Module] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.current:
            self.current, self.method = self.home, self.home_method

    def set(self, fmt: str) -> None:
        """Switch the model's linears to `fmt` ("bf16" | "mxfp4"); a no-op if they are in it already."""
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
        if fmt == self.current:
            return
        device = next(self.model.parameters()).device
        if fmt == self.home:
            swap_modules(self.model, {name: m.to(device) for name, m in self.stash.items()})
            self.stash, self.method = {}, self.home_method
        else:
            modules, self.method = self.build_other()
            old = swap_modules(self.model, modules)
            resident = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
            self.stash = {name: _offload(m, resident) for name, m in old.items()}
        self.current = fmt

    @property
    def stash_bytes(self) -> int:
        """Bytes held outside the running model so that switching back is exact."""
        return module_bytes(self.stash, exclude=list(self.model.parameters()))

    def memory(self) -> dict:
        """Weight accounting for the UI, `--json` and benchmarks: all weights, the linear ones, and the same
        linears in bf16; the running form, how its MXFP4 weights were made and what is kept to switch back."""
        linear, linear_bf16 = 0, 0
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                linear += module.weight.numel() * module.weight.element_size()
                linear_bf16 += module.weight.numel() * 2
            elif isinstance(module, Fp4Linear):  # packed codes + scales are its only copy of the weight
                linear += module.nbytes
                linear_bf16 += module.in_features * module.out_features * 2
        return {
            "weights_bytes": weight_bytes(self.model),
            "linear_weight_bytes": linear,
            "linear_weight_bytes_bf16": linear_bf16,
            "weights_format": self.current,  # "bf16" = unquantized, in the model dtype
            "weights_method": self.method,  # how the MXFP4 weights were made: gptq (cached), rtn-mse, ...
            "weights_restore_bytes": self.stash_bytes,  # host memory kept to switch back exactly
        }


def _offload(module: nn.Module, resident: set[int]) -> nn.Module:
    """Move a stashed module to host memory, unless it shares storage with the running model (a tied head)."""
    if any(t.untyped_storage().data_ptr() in resident for t in (*module.parameters(), *module.buffers())):
        return module
    return module.to(HOST)


def default_mxfp4(model: nn.Module, model_path: Path | None) -> tuple[dict[str, Fp4Linear], str]:
    """The MXFP4 form of a dense model for the toggle: the cached `specchat quantize` result, else RTN."""
    cached = cache_dir(model_path) if model_path is not None else None
    if cached is not None and is_mxfp4_checkpoint(cached):
        packed, meta = read_packed(cached)
        return fp4_modules(model, packed, meta["rotation"] is not None), f"{describe(meta)} (cached)"
    packed = round_to_nearest(model, select_linears(model), DEFAULT_RULE, DEFAULT_ROTATE)
    return fp4_modules(model, packed, DEFAULT_ROTATE), describe(
        {"method": "rtn", "rule": DEFAULT_RULE, "rotation": ROTATION if DEFAULT_ROTATE else None}
    )


def weight_switch(
    model: nn.Module, packed: Packed, meta: dict | None, model_path: Path | None, requested: str = "auto"
) -> WeightSwitch:
    """Install a checkpoint's MXFP4 linears (`packed`, described by its metadata `meta`), apply `requested`,
    and return the model's toggle.

    Home form: MXFP4 for a checkpoint with MXFP4 linears (bf16 then means their dequantized values), and for a
    dense model loaded with requested="mxfp4", whose dense linears are dropped so that the memory saving holds;
    otherwise bf16, and `default_mxfp4` makes the MXFP4 form on demand.
    """
    dtype = model.embed.weight.dtype
    to_dense = lambda: (dense_modules(model, dtype), None)
    if not packed and requested == "mxfp4":
        modules, method = default_mxfp4(model, model_path)
        swap_modules(model, modules)
        return WeightSwitch(model, "mxfp4", method, to_dense)
    if packed:
        swap_modules(model, fp4_modules(model, packed, meta["rotation"] is not None))
        switch = WeightSwitch(model, "mxfp4", describe(meta), to_dense)
    else:
        switch = WeightSwitch(model, "bf16", None, lambda: default_mxfp4(model, model_path))
    if requested != "auto":
        switch.set(requested)
    return switch
