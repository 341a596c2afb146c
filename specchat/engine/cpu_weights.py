"""A GGUF model's linears on the CPU read as the file stores them (Q4_1 / Q8_0 blocks), as a transform.

The loader dequantizes every GGUF tensor to float32 (engine/loader.py); a decode step then reads 4 bytes per
weight. `pack_blocks(model, gguf_path)` re-classes each `nn.Linear` whose every source tensor in the file is Q4_1
or Q8_0 as a `BlockLinear`, which keeps the file's blocks beside the float weight and multiplies the few rows of
a decode or verification step with kernels/cpu_gemv.py (0.625 / 1.06 bytes per weight). The weights are the
same numbers either way (the kernels dequantize as gguf does), so this costs no accuracy; rows above
cpu_gemv.MAX_ROWS (a prompt's prefill) keep the float GEMM with float rows. `unpack(model)` swaps the plain modules back
(docs/style.md #3, #6: the model code is unchanged, `--eager` never packs).

`set_activations(model, "int8")` re-classes the packed linears as `Int8BlockLinear`, which multiply with int8
activation rows (kernels/cpu_gemv_i8.py, AVX512-VNNI: `--cpu-act int8`); that rounds each activation to 8 bits
per block of 32, so unlike the packing it changes the numbers (docs/benchmarks.md measures the perplexity). Those
read only their repacked blocks, prompts included, so `release_unread_weights` frees their float weights (`.weight`
then reads as the blocks' values, made for the caller) and pages out the GGUF-layout blocks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specchat.engine.loader import gguf_reader
from specchat.engine.model import Linear, Transformer
from specchat.errors import note_not_saved
from specchat.kernels import cpu_build, cpu_gemv, cpu_gemv_i8
from specchat.quant.fp4_linear import set_fp4_activations

Q4_1_BYTES, Q8_0_BYTES = 20, 34  # bytes per block of 32: fp16 d (+ fp16 m) + codes

log = logging.getLogger(__name__)


# Rows above which a BlockLinear takes the float GEMM of its dequantized weight (None: never): a prompt's prefill.
_GEMM_ABOVE: ContextVar[int | None] = ContextVar("gemm_above", default=cpu_gemv.MAX_ROWS)


@contextmanager
def blocks_for_any_rows() -> Iterator[None]:
    """Within it, BlockLinear reads its blocks for any number of rows (no float GEMM). The runner's forward of a
    step's decoding requests runs in it: their block linears go through the whole-block call for any row count
    already, and so then does the output head, whose rows would otherwise change kernels (and rounding) with the
    number of requests decoding together."""
    token = _GEMM_ABOVE.set(None)
    try:
        yield
    finally:
        _GEMM_ABOVE.reset(token)


class BlockLinear(nn.Linear):
    """nn.Linear with the weight also held as GGUF blocks (buffers set by `pack_blocks`): small batches read
    the blocks, large ones the float weight. Output and bias as nn.Linear's."""

    kind: str  # "q4_1" | "q8_0"
    gemm_for_many_rows = True  # float rows: above cpu_gemv.MAX_ROWS the float GEMM is faster than the block kernels

    def __getattr__(self, name: str) -> torch.Tensor | nn.Module:
        # Only reached where normal lookup fails: `.weight` after `release_unread_weights` is the blocks' values,
        # made for the caller (the heads' draft rows, a switch to MXFP4, GPTQ), never kept.
        if name == "weight" and "weight" not in self._parameters and "codes" in self._buffers:
            return self.dequantized()
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: object) -> None:
        # A new weight is not what the blocks hold: the module becomes a plain linear over it (GPTQ rebinds the
        # weights of a block's twin to their quantized values and runs it; the blocks would ignore them).
        if name == "weight" and isinstance(value, torch.Tensor):
            _to_plain(self, keep_weight=False)
        nn.Module.__setattr__(self, name, value)

    def dequantized(self) -> torch.Tensor:
        """The weight's float32 values from its blocks: the loader's values, bit for bit (gguf's dequantization,
        kernels/cpu_gemv.py)."""
        return self._dequantize(self._buffers["codes"], self._buffers["d"], self._buffers.get("m"))

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [R] of the weight, dequantized: [R, K] in `dtype` (as Fp4Linear.rows)."""
        codes, d, m = self._buffers["codes"], self._buffers["d"], self._buffers.get("m")
        return self._dequantize(codes[index], d[index], None if m is None else m[index]).to(dtype)

    def _dequantize(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemv.q4_dequantize(codes, d, m) if self.kind == "q4_1" else cpu_gemv.q8_dequantize(codes, d)

    @property
    def gguf_type(self) -> str:
        """The file's block type, as GGUF names it ("Q4_1", "Q8_0"): what the memory panel shows."""
        return self.kind.upper()

    @property
    def holds_weight(self) -> bool:
        """Whether the float weight is resident beside the blocks (see `release_unread_weights`)."""
        return "weight" in self._parameters

    @property
    def nbytes(self) -> int:
        """Resident bytes of this weight: its blocks, their int8 repack if made (buffers too), the float weight
        if held, the bias."""
        tensors = [*self._parameters.values(), *self._buffers.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def bound(self) -> cpu_gemv.Bound:
        """The blocks checked and bound for the kernels (once; again after the buffers were replaced, e.g. .to())."""
        bound = self.__dict__.get("_bound")
        if bound is None or bound.tensors[0] is not self._buffers["codes"]:
            bound = self.__dict__["_bound"] = cpu_gemv.Bound(
                self.codes, self.d, self.m if self.kind == "q4_1" else None
            )
        return bound

    def takes_gemm(self, rows: int) -> bool:
        """Whether `rows` rows take the float GEMM here rather than the blocks."""
        gemm_above = _GEMM_ABOVE.get() if self.gemm_for_many_rows else None
        return gemm_above is not None and rows > gemm_above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~121 times a token: a decode step's [T, K] float32 rows go through without a reshape or cast, and
        # the buffers are read from the module's dicts (an nn.Module attribute lookup costs ~1 us).
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if self.takes_gemm(rows.shape[0]):
            return F.linear(x, self.weight, self.bias)
        y = self.bound()(rows.float().contiguous(), torch.get_num_threads())
        bias = self._parameters["bias"]
        if bias is not None:
            y += bias
        if rows is x and x.dtype == torch.float32:
            return y
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


class Int8BlockLinear(BlockLinear):
    """BlockLinear whose rows are quantized to int8 per block of 32 and multiply the blocks repacked for
    kernels/cpu_gemv_i8.py (made once, kept beside the GGUF blocks), for any number of rows: faster than the
    float GEMM for a prompt's prefill too (2 cores, default model, 128-512 rows: 1.4-2.6x), and a row then takes the
    same kernel whatever its step's size, so prefix-cached and chunked prompts keep their bits."""

    gemm_for_many_rows = False

    def bound(self) -> cpu_gemv_i8.Bound:
        """The repacked blocks bound for the int8 kernels (once; again after the buffers were replaced)."""
        bound = self.__dict__.get("_bound_i8")
        if bound is None or bound[0] is not self._buffers["codes"]:
            bound = self.__dict__["_bound_i8"] = (
                self.codes,
                cpu_gemv_i8.Bound(self.codes, self.d, self.m if self.kind == "q4_1" else None),
            )
            for i, t in enumerate(bound[1].tensors):  # buffers, so that the model's bytes count them
                self.register_buffer(f"repacked_{i}", t, persistent=False)
        return bound[1]


class Bf16Linear(Linear):
    """nn.Linear over a bfloat16 weight on the CPU (a bf16 model: `cpu_fusion.fuse`): a decode or verification
    step's few rows go through kernels/cpu_gemv.bf16_linear, which reads the weight as it is stored and sums in
    float32 (torch's bf16 linears read it at about half the bandwidth on this CPU: docs/benchmarks.md, "Forty-first
    session"), each row alone, so a row's output does not depend on its batch; rows above cpu_gemv.MAX_ROWS (a
    prompt) take torch's GEMM, as BlockLinear's float rows do. Output and bias as nn.Linear's."""

    def bound(self) -> cpu_gemv.Bound | None:
        """The weight bound for the kernel (again after it was replaced), or None where it cannot take it."""
        weight = self.weight
        bound = self.__dict__.get("_bound")
        if bound is None or bound[0] != weight.data_ptr():
            ok = weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape[1] % cpu_gemv.BLOCK == 0
            bound = self.__dict__["_bound"] = (weight.data_ptr(), cpu_gemv.Bound(weight.detach()) if ok else None)
        return bound[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        gemm_above = _GEMM_ABOVE.get()
        bound = self.bound() if x.dtype == torch.bfloat16 and not x.is_cuda else None
        if bound is None or (gemm_above is not None and rows.shape[0] > gemm_above):
            return F.linear(x, self.weight, self.bias)
        y = bound(rows.float().contiguous(), torch.get_num_threads())
        bias = self._parameters["bias"]
        if bias is not None:
            y += bias
        return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


ACTIVATION_CLASSES = {"fp32": BlockLinear, "int8": Int8BlockLinear}  # config.CPU_ACTIVATIONS -> linear class


def set_activations(model: nn.Module, activations: str) -> int:
    """Make the linears the CPU kernels read (GGUF blocks, and MXFP4 codes: `Fp4Linear.set_activations`) multiply
    with `activations` ("fp32" or "int8") rows; returns how many do. int8 needs cpu_gemv_i8.available() (a CPU with
    AVX512-VNNI or AVX2); the caller checks it. A block linear's repacked blocks stay with it once made, so switching
    back and forth (benchmarks/spec_decode.py --cpu-act) costs nothing; an MXFP4 one repacks its codes in place.

    fp32 rows take the float GEMM for a prompt: a linear's float weight dropped under int8 rows
    (`release_unread_weights`) is made again, from the blocks."""
    cls = ACTIVATION_CLASSES[activations]
    assert cls is BlockLinear or cpu_gemv_i8.available(), "cpu_gemv_i8.available() is False"
    count = 0
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.__class__ = cls
            module.bound()  # int8: repacked now (~0.5 s for the default model), not in the first step
            if cls.gemm_for_many_rows:
                _restore_weight(module)
            count += 1
    return count + set_fp4_activations(model, activations)


def release_unread_weights(model: nn.Module) -> int:
    """What the linears that read only their int8 repack (int8 rows: a prompt's too) no longer read, released;
    returns how many linears. Their float weights are freed, except one another module holds (a tied output head's
    is the embedding's): `.weight` then reads as the blocks' values, made on each read. Where the weights were
    dequantized from the file at this load (no cache yet) they were ~425 MB of the default model's process,
    float32; `set_activations(model, "fp32")` makes them again. Their GGUF blocks stay, for those reads, but their
    pages go back (`cpu_build.page_out`): mapped from the cached blocks file, they are read from it again if ever
    read (the default model's 106 MB at every load after the first)."""
    held: dict[int, int] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                held[id(parameter)] = held.get(id(parameter), 0) + 1
    linears = [module for module in model.modules() if isinstance(module, Int8BlockLinear)]
    for linear in linears:
        weight = linear._parameters.get("weight")
        if weight is not None and held[id(weight)] == 1:
            del linear._parameters["weight"]
    cpu_build.page_out(t for linear in linears for name, t in linear._buffers.items() if name in ("codes", "d", "m"))
    return len(linears)


def _restore_weight(linear: BlockLinear) -> None:
    """The float weight resident again (dequantized from the blocks: the values it had), where it was dropped."""
    if "weight" not in linear._parameters:
        linear._parameters["weight"] = nn.Parameter(linear.dequantized(), requires_grad=False)


def _q4_1(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_1 bytes of a [rows, K] tensor -> codes [rows, K/2], d, m [rows, K/32] (float32)."""
    blocks = raw.reshape(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 4:]).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def _q8_0(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q8_0 bytes of a [rows, K] tensor -> codes int8 [rows, K], d [rows, K/32] (float32)."""
    blocks = raw.reshape(rows, -1, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return torch.from_numpy(codes), torch.from_numpy(d)


def _unpermute_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """loader._unpermute_rope on rows of any trailing shape (a row's blocks move with it)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _sources(model: Transformer) -> dict[str, list[tuple[str, int | None]]]:
    """Our linear name -> its GGUF tensors in row order, each with the head count whose rope rows it permutes."""
    cfg = model.cfg
    permuted = cfg.arch == "llama"
    heads = (cfg.num_heads, cfg.num_kv_heads) if permuted else (None, None)
    out = {}
    for i in range(cfg.num_layers):
        b, o = f"blk.{i}.", f"layers.{i}."
        out[o + "attn.wqkv"] = [
            (b + "attn_q.weight", heads[0]),
            (b + "attn_k.weight", heads[1]),
            (b + "attn_v.weight", None),
        ]
        out[o + "attn.wo"] = [(b + "attn_output.weight", None)]
        out[o + "mlp.w_gate_up"] = [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)]
        out[o + "mlp.w_down"] = [(b + "ffn_down.weight", None)]
    return out


def _blocks(tensors: dict, names: list[tuple[str, int | None]]) -> tuple[str, tuple[torch.Tensor, ...]] | None:
    """The blocks of the tensors `names` concatenated along rows, if all are Q4_1 or all Q8_0; else None."""
    from gguf import GGMLQuantizationType as Q

    parts = [tensors.get(name) for name, _ in names]
    if any(t is None for t in parts):
        return None
    kinds = {t.tensor_type for t in parts}
    if kinds not in ({Q.Q4_1}, {Q.Q8_0}):
        return None
    kind = "q4_1" if kinds == {Q.Q4_1} else "q8_0"
    read = _q4_1 if kind == "q4_1" else _q8_0
    pieces = []
    for t, (_, heads) in zip(parts, names, strict=True):
        arrays = read(np.asarray(t.data), int(t.shape[-1]))
        pieces.append([_unpermute_rows(a, heads) if heads else a for a in arrays])
    return kind, tuple(torch.cat(column).contiguous() for column in zip(*pieces, strict=True))


def read_blocks(model: Transformer, gguf_path: Path) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]]:
    """{linear name: (kind, (codes, d[, m]))} for the model's linears that the GGUF file stores as blocks."""
    tensors = {t.name: t for t in gguf_reader(gguf_path).tensors}
    names = _sources(model)
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    names["lm_head"] = [(head, None)]
    found = {name: _blocks(tensors, sources) for name, sources in names.items()}
    return {name: blocks for name, blocks in found.items() if blocks is not None}


def _save(cache: Path, blocks: dict[str, tuple[str, tuple[torch.Tensor, ...]]]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {f"{name}.{i}": t for name, (_, arrays) in blocks.items() for i, t in enumerate(arrays)}
    partial = cache.with_suffix(f".partial-{os.getpid()}")
    try:
        save_file(tensors, str(partial), metadata={name: kind for name, (kind, _) in blocks.items()})
        os.replace(partial, cache)
    except (OSError, SafetensorError) as exc:  # a full disk, a read-only folder: packed again at the next load
        note_not_saved(log, cache, exc)
        with suppress(OSError):  # NotADirectoryError where the folder is a file
            partial.unlink(missing_ok=True)


def _load(cache: Path) -> dict[str, tuple[str, tuple[torch.Tensor, ...]]] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(cache), "pt") as f:
            kinds, keys = f.metadata() or {}, set(f.keys())
            out = {}
            for name, kind in kinds.items():
                count = 3 if kind == "q4_1" else 2
                if any(f"{name}.{i}" not in keys for i in range(count)):
                    return None
                out[name] = (kind, tuple(f.get_tensor(f"{name}.{i}") for i in range(count)))
            return out
    except Exception:  # safetensors raises its own error types on damaged files; the cache is rebuilt
        return None


def pack_blocks(model: Transformer, gguf_path: Path, cache: Path | None = None) -> int:
    """Re-class the model's linears that the GGUF file stores as Q4_1 / Q8_0 blocks (float32 model only);
    returns how many. The float weights stay: large batches and `unpack` use them. With `cache` (a safetensors
    path) the blocks are read from the file once (parsing a GGUF takes seconds) and from the cache after."""
    if not cpu_gemv.available() or next(model.parameters()).dtype != torch.float32:
        return 0
    blocks = _load(cache) if cache is not None and cache.exists() else None
    if blocks is None:
        blocks = read_blocks(model, gguf_path)
        if cache is not None:
            _save(cache, blocks)
    packed = 0
    modules = dict(model.named_modules())
    for name, (kind, arrays) in blocks.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear) or isinstance(linear, BlockLinear) or kind not in ("q4_1", "q8_0"):
            continue
        if arrays[0].shape[0] != linear.out_features or arrays[1].shape[1] * 32 != linear.in_features:
            continue
        as_block_linear(linear, kind, arrays)
        packed += 1
    return packed


def as_block_linear(linear: nn.Linear, kind: str, blocks: tuple[torch.Tensor, ...]) -> BlockLinear:
    """Re-class `linear` in place to read GGUF `blocks` of its weight ("q4_1": codes, d, m; "q8_0": codes, d)."""
    linear.__class__ = BlockLinear
    linear.kind = kind
    for buffer, value in zip(("codes", "d", "m"), blocks, strict=False):
        linear.register_buffer(buffer, value, persistent=False)
    return linear


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> its Q8_0 blocks as pack_blocks holds a GGUF file's (codes int8 [N, K], d float32 [N, K/32]):
    gguf's own quantizer (d = max|w| / 127 per block of 32, as float16), its bytes read as `read_blocks` reads."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return _q8_0(raw, weight.shape[0])


def unpack(model: nn.Module) -> int:
    """Back to plain nn.Linear modules (the float weights were kept); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, BlockLinear):
            _to_plain(module, keep_weight=True)
            count += 1
    return count


def _to_plain(linear: BlockLinear, keep_weight: bool) -> None:
    """Re-class a BlockLinear as nn.Linear, its blocks and their bindings dropped (the float weight made again
    from them first, if `keep_weight` and it was dropped)."""
    if keep_weight:
        _restore_weight(linear)
    for buffer in [name for name in linear._buffers if name in ("codes", "d", "m") or name.startswith("repacked_")]:
        del linear._buffers[buffer]
    linear.__dict__.pop("_bound", None)
    linear.__dict__.pop("_bound_i8", None)
    linear.__class__ = nn.Linear
