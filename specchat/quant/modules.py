"""Quantization as a transform of the model's modules: pick linears, build their MXFP4 or dense form, swap them.

The model's code never asks whether it is quantized (docs/style.md #6, after gpt-fast's quantize.py): which
modules sit in `model.layers[i].attn.wqkv` and friends decides it.

Layer selection: a comma-separated list of terms applied in order. A term is `blocks` (every linear inside the
transformer blocks: attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down), `lm_head`, `all` (both), or an fnmatch
pattern over module names (`layers.*.mlp.w_down`); a leading `-` removes what the term matches. The default,
`all`, includes the output head: on the default model it is a fifth of the linear weights, and without it the
MXFP4 model keeps 0.42x the bf16 bytes instead of 0.27x (docs/benchmarks.md).

A tied embedding (the output head's matrix, also used for token lookup) follows the head: when the head is
MXFP4 the embedding becomes a `TiedEmbedding` reading the head's rows (`mxfp4_modules`), so the matrix is held
once, as MXFP4; when the head goes back to dense, so does the embedding, sharing its weight again.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch
from torch import nn

from specchat.config import DEFAULT_QUANT_LAYERS
from specchat.kernels.mxfp4 import Rule, quantize_mxfp4
from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear, TiedEmbedding, rotate_blocks

Progress = Callable[[str, int, int], None]  # (what, done, total)

ROTATION = "hadamard32"
LINEAR_TYPES = (nn.Linear, Fp4Linear)
BLOCK_LINEARS = "layers.*"
HEAD, EMBED = "lm_head", "embed"

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


def select_linears(model: nn.Module, layers: str = DEFAULT_QUANT_LAYERS) -> list[str]:
    """Module names chosen by a layer selection (see the module docstring), in module order."""
    names = linear_names(model)
    chosen: set[str] = set()
    for raw in layers.split(","):
        term = raw.strip()
        if not term:
            continue
        remove = term.startswith("-")
        term = term.removeprefix("-")
        patterns = {"blocks": [BLOCK_LINEARS], "all": [BLOCK_LINEARS, HEAD]}.get(term, [term])
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


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in (its embedding's, dense or MXFP4)."""
    embed = model.get_submodule(EMBED)
    return embed.dtype if isinstance(embed, TiedEmbedding) else embed.weight.dtype


def tied(model: nn.Module) -> bool:
    return bool(model.cfg.tie_embeddings)


def round_to_nearest(
    model: nn.Module, names: Sequence[str], rule: Rule = "mse", rotate: bool = False, progress: Progress | None = None
) -> Packed:
    """MXFP4 codes and scales of the named dense linears (of W R if `rotate`), block scales by `rule`, RNE;
    `progress` hears ("round to nearest", linears done, linears)."""
    packed = {}
    for name in names:
        weight = model.get_submodule(name).weight.detach()
        packed[name] = quantize_mxfp4(rotate_blocks(weight) if rotate else weight, rule=rule)
        if progress:
            progress("round to nearest", len(packed), len(names))
    return packed


def fp4_modules(
    model: nn.Module, packed: Packed, rotated: bool = False, dtype: torch.dtype | None = None
) -> dict[str, Fp4Linear]:
    """Fp4Linear modules (RotatedFp4Linear if the packed weights are W R) for the named linears of `model`, on
    its device, biases copied from the modules they replace, computing in `dtype` (default: the model's,
    `model_dtype`; a module without an embedding, such as an EAGLE-3 head, passes its own)."""
    device = next(model.parameters()).device
    dtype = model_dtype(model) if dtype is None else dtype
    cls = RotatedFp4Linear if rotated else Fp4Linear
    modules = {}
    for name, (codes, scales) in packed.items():
        old = model.get_submodule(name)
        bias = None if old.bias is None else old.bias.detach().clone()
        modules[name] = cls.from_packed(codes.to(device), scales.to(device), old.in_features, bias, dtype)
    return modules


def quantize_linears(
    model: nn.Module, names: Sequence[str], rule: Rule = "mse", dtype: torch.dtype | None = None
) -> dict[str, nn.Module]:
    """The named dense linears of `model` as MXFP4 in place, by round to nearest (`rule`), computing in `dtype`
    (`fp4_modules`); returns the dense modules they replace."""
    return swap_modules(model, fp4_modules(model, round_to_nearest(model, names, rule), dtype=dtype))


def mxfp4_modules(model: nn.Module, packed: Packed, rotated: bool = False) -> dict[str, nn.Module]:
    """`fp4_modules`, and for a tied head a `TiedEmbedding` over the new head in place of the dense embedding."""
    modules: dict[str, nn.Module] = dict(fp4_modules(model, packed, rotated))
    if HEAD in modules and tied(model):
        modules[EMBED] = TiedEmbedding(modules[HEAD], model_dtype(model))
    return modules


def dense_modules(model: nn.Module, dtype: torch.dtype) -> dict[str, nn.Module]:
    """Dense modules holding the dequantized values (in `dtype`) of every MXFP4 module of `model`; a tied
    embedding shares the dense head's weight."""
    return dense_from(model, {name: m.dequantized(dtype) for name, m in fp4_items(model)})


def fp4_items(model: nn.Module) -> list[tuple[str, Fp4Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Fp4Linear)]


def dense_from(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    """nn.Linear modules for the named MXFP4 linears of `model` holding `weights` [N, K] (biases from the MXFP4
    modules), and an nn.Embedding sharing the head's weight if the embedding is tied to it."""
    modules: dict[str, nn.Module] = {}
    for name, weight in weights.items():
        fp4 = model.get_submodule(name)
        with torch.device("meta"):
            linear = nn.Linear(fp4.in_features, fp4.out_features, bias=fp4.bias is not None)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if fp4.bias is not None:
            linear.bias = nn.Parameter(fp4.bias.detach().clone(), requires_grad=False)
        modules[name] = linear
    if HEAD in modules and isinstance(model.get_submodule(EMBED), TiedEmbedding):
        with torch.device("meta"):
            embed = nn.Embedding(model.cfg.vocab_size, model.cfg.hidden_size)
        embed.weight = modules[HEAD].weight
        modules[EMBED] = embed
    return modules


def packed_state(model: nn.Module) -> Packed:
    """The interchange (codes, scales) of every Fp4Linear of `model`."""
    return {name: m.packed() for name, m in fp4_items(model)}


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
