"""The live bf16 <-> MXFP4 toggle of a model's weights: `WeightSwitch`, built at load by `weight_switch`.

The two forms are quant.modules': dense (nn.Linear in the model dtype) and MXFP4 (Fp4Linear, and for a tied
output head a TiedEmbedding reading the head's rows). Neither is kept in memory while the other runs; each comes
back from a file when the switch needs it.

Where the MXFP4 form comes from, in order (reported as `weights_method`):
1. the MXFP4 checkpoint the model was loaded from: its method ("gptq-rot", "rtn-roundup", ...);
2. the model's cached checkpoint (quant.checkpoint.cache_dir): `<method> (cached)`. GPTQ with the 32-point
   block rotation over every linear, the output head included (quant.quantize's defaults), made once per model
   file by `specchat quantize` or by the first switch (`prepare`, with progress: minutes on a CPU), then read
   back in about a second;
3. round to nearest with the least-squares scale rule over the block linears ("rtn-mse"), the fallback when
   GPTQ cannot run: a model with no file to key a cache by, or no tokenizer for the calibration text. The head
   stays dense there: rounded to nearest it costs more quality than all the blocks (docs/benchmarks.md).

Where the dense form comes from: the model file's tensors in our names (quant.dense_file: the GGUF's converted
weights, or a file the switch writes once); for a model loaded from an MXFP4 checkpoint, which has no dense
weights, the dequantized MXFP4 values. Only a model built in memory, with no file, keeps the dense form in host
memory while MXFP4 runs (`weights_restore_bytes`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specchat.config import WEIGHT_FORMATS
from specchat.quant.checkpoint import cache_dir, describe, is_mxfp4_checkpoint, read_packed
from specchat.quant.dense_file import dense_cache_file, holds, read_dense, write_dense
from specchat.quant.fp4_linear import Fp4Linear
from specchat.quant.modules import (
    EMBED,
    HEAD,
    Packed,
    dense_from,
    dense_modules,
    fp4_items,
    model_dtype,
    module_bytes,
    mxfp4_modules,
    round_to_nearest,
    select_linears,
    swap_modules,
    tied,
    weight_bytes,
)
from specchat.quant.quantize import QuantizeSettings, quantize_to_checkpoint

FALLBACK_RULE = "mse"  # round to nearest's best scale rule (docs/benchmarks.md: mse < roundup < ocp)
FALLBACK_LAYERS = "blocks"
HOST = torch.device("cpu")

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass(slots=True)
class WeightSources:
    """What a model's weight switch reads its forms from (see the module docstring)."""

    model_path: Path | None = None  # the file or folder the model was loaded from: keys the caches
    checkpoint: bool = False  # model_path is an MXFP4 checkpoint: the home of the MXFP4 form
    dense_file: Path | None = None  # safetensors in our names with the dense tensors (a GGUF's converted weights)
    encode: Callable[[str], Sequence[int]] | None = None  # the tokenizer, for GPTQ's calibration text
    tokenizer_dir: Path | None = None  # its files, copied beside the cached checkpoint

    @property
    def cache(self) -> Path | None:
        """The model's cached MXFP4 checkpoint, if the model has a file."""
        return cache_dir(self.model_path) if self.model_path is not None and not self.checkpoint else None

    @property
    def can_calibrate(self) -> bool:
        return self.cache is not None and self.encode is not None


@dataclass
class WeightSwitch:
    """Live bf16 <-> MXFP4 toggle of a model's linear weights (and of a tied embedding, with its head).

    `set` runs between engine steps and swaps modules; `prepare` does the slow part of a first switch (GPTQ into
    the cache) without touching the model, on any thread, so that `set` is quick. A lock keeps the two apart.
    """

    model: nn.Module
    sources: WeightSources
    current: str = "bf16"  # the form running now: "bf16" (unquantized, the model dtype) | "mxfp4"
    method: str | None = None  # how the running MXFP4 weights were made
    progress: Progress | None = None  # hears a GPTQ calibration that `set` has to run itself
    stash: dict[str, nn.Module] = field(default_factory=dict)  # the dense form, only when no file holds it
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def prepare(self, fmt: str, progress: Progress | None = None) -> None:
        """Make what switching to `fmt` needs that takes long, without changing the model: the GPTQ checkpoint
        of a dense model, if nothing is cached yet (`progress` hears ("GPTQ", linears done, linears))."""
        _check(fmt)
        with self.lock:
            if fmt == "mxfp4" and self.current == "bf16":
                self._calibrate(progress or self.progress)

    def set(self, fmt: str) -> None:
        """Switch the model to `fmt` ("bf16" | "mxfp4"); a no-op if it is in it already."""
        _check(fmt)
        with self.lock:
            if fmt == self.current:
                return
            if fmt == "mxfp4":
                self._to_mxfp4()
            else:
                self._to_dense()
            self.current = fmt

    # --- the MXFP4 form ---------------------------------------------------------------------------------------
    def _calibrate(self, progress: Progress | None) -> None:
        """GPTQ the dense model into its cache, unless a checkpoint is there (of any settings: `specchat
        quantize` may have put one there on purpose) or GPTQ cannot run."""
        cache = self.sources.cache
        if not self.sources.can_calibrate or is_mxfp4_checkpoint(cache):
            return
        path = self.sources.model_path
        quantize_to_checkpoint(
            self.model,
            self.sources.encode,
            QuantizeSettings(),
            path,
            path.name,
            self.sources.tokenizer_dir or path,
            out=None,
            progress=progress,
        )

    def _mxfp4_weights(self) -> tuple[Packed, bool, str]:
        """(packed weights, rotated, method) from the first source that has them (see the module docstring)."""
        if self.sources.checkpoint:
            packed, meta = read_packed(self.sources.model_path)
            return packed, meta["rotation"] is not None, describe(meta)
        self._calibrate(self.progress)
        cache = self.sources.cache
        if cache is not None and is_mxfp4_checkpoint(cache):
            packed, meta = read_packed(cache)
            return packed, meta["rotation"] is not None, f"{describe(meta)} (cached)"
        names = select_linears(self.model, FALLBACK_LAYERS)
        packed = round_to_nearest(self.model, names, FALLBACK_RULE)
        return packed, False, describe({"method": "rtn", "rule": FALLBACK_RULE})

    def _to_mxfp4(self) -> None:
        packed, rotated, method = self._mxfp4_weights()
        modules = mxfp4_modules(self.model, packed, rotated)
        if not self.sources.checkpoint and not self._dense_on_disk(list(packed)):
            self.stash = {name: self.model.get_submodule(name) for name in modules}
        swap_modules(self.model, modules)
        resident = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
        self.stash = {name: _offload(m, resident) for name, m in self.stash.items()}
        self.method = method

    # --- the dense form ---------------------------------------------------------------------------------------
    def _tensor_name(self, linear: str) -> str:
        """The dense file's name for a linear's weight (a tied head's is the embedding's)."""
        return f"{EMBED}.weight" if linear == HEAD and tied(self.model) else f"{linear}.weight"

    def _dense_file(self, linears: list[str]) -> Path | None:
        """A dense file holding these linears' weights, if there is one."""
        names = [self._tensor_name(n) for n in linears]
        own = dense_cache_file(self.sources.model_path, model_dtype(self.model)) if self.sources.model_path else None
        return next((f for f in (self.sources.dense_file, own) if holds(f, names)), None)

    def _dense_on_disk(self, linears: list[str]) -> bool:
        """Make sure a file holds the dense weights of `linears` before they are dropped; False if none can."""
        if self._dense_file(linears) is not None:
            return True
        if self.sources.model_path is None:
            return False
        tensors = {self._tensor_name(n): self.model.get_submodule(n).weight for n in linears}
        write_dense(dense_cache_file(self.sources.model_path, model_dtype(self.model)), tensors)
        return True

    def _to_dense(self) -> None:
        device, dtype = self.device, model_dtype(self.model)
        if self.stash:
            swap_modules(self.model, {name: m.to(device) for name, m in self.stash.items()})
            self.stash = {}
        elif self.sources.checkpoint:  # no dense weights exist: their dequantized values
            swap_modules(self.model, dense_modules(self.model, dtype))
        else:
            linears = [name for name, _ in fp4_items(self.model)]
            path = self._dense_file(linears)
            if path is None:
                raise RuntimeError(f"no file holds the dense weights of {linears[0]} and {len(linears) - 1} more")
            names = {n: self._tensor_name(n) for n in linears}
            tensors = read_dense(path, sorted(set(names.values())), dtype, device)
            swap_modules(self.model, dense_from(self.model, {n: tensors[t] for n, t in names.items()}))
        self.method = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # --- accounting -------------------------------------------------------------------------------------------
    @property
    def needs_gptq(self) -> bool:
        """Whether a switch to MXFP4 would run GPTQ first (no checkpoint cached yet: minutes on a CPU)."""
        try:
            return self.current == "bf16" and self.sources.can_calibrate and not is_mxfp4_checkpoint(self.sources.cache)
        except OSError:  # the model file is gone (its cache is keyed by its stat): the switch itself will say so
            return False

    @property
    def stash_bytes(self) -> int:
        """Bytes held outside the running model so that switching back is possible."""
        return module_bytes(self.stash, exclude=list(self.model.parameters()))

    def memory(self) -> dict:
        """Weight accounting for the UI, `--json` and benchmarks: all weights, the linear ones (the output head
        included), and the same linears in bf16; the running form, how its MXFP4 weights were made, and what
        is kept in memory to switch back (nothing, unless the model has no file)."""
        linear, linear_bf16, gguf_types, sources = 0, 0, set(), set()
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, Fp4Linear)):
                gguf_types.add(getattr(module, "gguf_type", None))
                sources.update(getattr(module, "source", "").split("+"))
                # An Fp4Linear's packed codes + scales are its only copy of the weight; a CPU linear reading a GGUF
                # file's blocks (engine/cpu_weights.py) counts its blocks and what it holds beside them.
                stored = getattr(module, "nbytes", None)
                linear += module.weight.numel() * module.weight.element_size() if stored is None else stored
                linear_bf16 += module.in_features * module.out_features * 2
        return {
            "weights_bytes": weight_bytes(self.model),
            "linear_weight_bytes": linear,
            "linear_weight_bytes_bf16": linear_bf16,
            "weights_format": self.current,  # "bf16" = unquantized, in the model dtype
            "weights_dtype": str(model_dtype(self.model)).removeprefix("torch."),
            "weights_method": self.method,  # how the MXFP4 weights were made: gptq-rot (cached), rtn-mse, ...
            "weights_mxfp4_needs_gptq": self.needs_gptq,  # what the TUI warns of before a switch
            "weights_restore_bytes": self.stash_bytes,  # memory kept to switch back
            # the GGUF block types the CPU kernels read the file's linears as ("Q4_1+Q8_0"; "Q4_1+Q8_0 from
            # Q4_K+Q6_K" where the file stores others: engine/cpu_weights.py), None where none
            "weights_gguf": _gguf_label(gguf_types - {None}, sources - {""}),
        }


def _gguf_label(kinds: set[str], sources: set[str]) -> str | None:
    """The block kinds read, "Q4_1+Q8_0", and the file's types where they differ: "Q4_1+Q8_0 from Q4_K+Q6_K"."""
    if not kinds:
        return None
    label = "+".join(sorted(kinds))
    return label if sources <= kinds else f"{label} from {'+'.join(sorted(sources))}"


def _check(fmt: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")


def _offload(module: nn.Module, resident: set[int]) -> nn.Module:
    """Move a stashed module to host memory, unless it shares storage with the running model."""
    if any(t.untyped_storage().data_ptr() in resident for t in (*module.parameters(), *module.buffers())):
        return module
    return module.to(HOST)


def weight_switch(
    model: nn.Module,
    packed: Packed,
    meta: dict | None,
    model_path: Path | None,
    requested: str = "auto",
    *,
    dense_file: Path | None = None,
    encode: Callable[[str], Sequence[int]] | None = None,
    tokenizer_dir: Path | None = None,
    progress: Progress | None = None,
) -> WeightSwitch:
    """Install a checkpoint's MXFP4 modules (`packed`, described by its metadata `meta`), apply `requested`
    ("auto" keeps what the checkpoint stores) and return the model's switch.

    model_path: the model's file or folder (None for a model built in memory); dense_file: a safetensors file in
    our names holding its dense weights, if the loader made one; encode, tokenizer_dir: its tokenizer, which
    GPTQ needs; progress: hears a GPTQ calibration the switch has to run.
    """
    if packed:
        swap_modules(model, mxfp4_modules(model, packed, meta["rotation"] is not None))
        sources = WeightSources(model_path, checkpoint=True)
        switch = WeightSwitch(model, sources, "mxfp4", describe(meta), progress)
    else:
        sources = WeightSources(model_path, False, dense_file, encode, tokenizer_dir)
        switch = WeightSwitch(model, sources, progress=progress)
    if requested != "auto":
        switch.set(requested)
    return switch
