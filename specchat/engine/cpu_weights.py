"""A GGUF model's linears on the CPU read as the file stores them (Q4_1 / Q8_0 blocks), as a transform.

The loader dequantizes every GGUF tensor to float32 (engine/loader.py); a decode step then reads 4 bytes per
weight. `pack_blocks(model, gguf_path)` re-classes each `nn.Linear` whose every source tensor in the file is
quantized as a `BlockLinear`, which keeps the file's blocks beside the float weight and multiplies the few rows of
a decode or verification step with kernels/cpu_gemv.py (0.625 / 1.06 bytes per weight). For Q4_1, Q8_0 and Q4_0
files the weights are the same numbers either way (the kernels dequantize as gguf does), so this costs no
accuracy; Q4_K is read as Q4_1 blocks whose scales are rounded to float16, the other quantized types (Q6_K, Q5_K,
...) as Q8_0 blocks requantized from their values (AS_Q4_1, QUANTIZED: docs/benchmarks.md measures what that
changes). Rows above cpu_gemv.MAX_ROWS (a prompt's prefill) keep the float GEMM with float rows. `unpack(model)`
swaps the plain modules back (docs/style.md #3, #6: the model code is unchanged, `--eager` never packs).

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
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specchat.engine.gguf_file import q4_0_arrays, q4_1_arrays, q8_0_arrays
from specchat.engine.loader import Progress, gguf_reader
from specchat.engine.model import Linear, ModelConfig, Transformer
from specchat.errors import ModelFormatError, note_not_saved
from specchat.kernels import cpu_build, cpu_gemv, cpu_gemv_i8
from specchat.quant.fp4_linear import TiedEmbedding, set_fp4_activations

Q4_K_BYTES = 144  # Q4_K: fp16 d, dmin, 12 bytes of scales, 256 codes

# The GGUF types of a linear's tensors that the kernels read: Q4_1 and Q8_0 as stored, Q4_0 and Q4_K as the Q4_1
# blocks of 32 that hold the same values (`as_q4_1`), every other quantized type requantized to Q8_0 from its
# values (`as_q8_0`): the K-quant files most models are published in (Q4_K_M: Q4_K with Q6_K for some tensors)
# decode on the block kernels instead of as float32 weights, 4 bytes each. Float tensors (F32, F16, BF16) are not
# read as blocks.
AS_Q4_1 = frozenset({"Q4_1", "Q4_0", "Q4_K"})
QUANTIZED = AS_Q4_1 | {
    "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
    "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
}  # fmt: skip


BLOCKS_STAGE = "reading CPU weight blocks"  # the progress label of a first load's conversion (read_blocks)

# The blocks cache's format, in its metadata: a cache of another (one written before K-quants were read, holding
# only a K-quant file's Q4_1 / Q8_0 linears; or before an untied embedding's blocks were kept) is rebuilt.
CACHE_FORMAT = "3"


class Blocks(NamedTuple):
    """A linear's weight as the kernels read it: `kind` "q4_1" (codes, d, m) or "q8_0" (codes, d), and the GGUF
    types of the file's tensors it was read from ("Q4_K+Q6_K"; the kind's own name where read as stored)."""

    kind: str
    arrays: tuple[torch.Tensor, ...]
    source: str


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
    source: str  # the GGUF types of the file's tensors the blocks were read from, "+"-joined
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

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values from its blocks, float32 unless `dtype`: the loader's values, bit for bit (gguf's
        dequantization, kernels/cpu_gemv.py), where the file stored them as these blocks hold them (`source`;
        module docstring)."""
        return block_values(self, dtype=dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [R] of the weight, dequantized: [R, K] in `dtype` (as Fp4Linear.rows)."""
        return block_values(self, index, dtype)

    @property
    def gguf_type(self) -> str:
        """The block type the kernels read, as GGUF names it ("Q4_1", "Q8_0"); the file's types it was read from
        are `source` ("Q4_K+Q6_K"). The memory panel shows both."""
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


def _q4_k(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_K bytes -> Q4_1 arrays. A super-block of 256 holds 8 sub-blocks of 32, w = d * sc * q - dmin * mn
    with 6-bit sc and mn: each sub-block is a Q4_1 block with scale d * sc and offset -dmin * mn, rounded to
    float16 as the int8 kernels hold block scales (a relative change of at most 2^-11 in a scale; exact where it
    fits). Its codes are 4 x 32 bytes, the low nibbles one sub-block and the high ones the next; a Q4_1 block's
    16 bytes hold its values 0-15 in the low nibbles and 16-31 in the high ones."""
    from gguf.quants import Q4_K

    blocks = raw.reshape(-1, Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = (d * sc).astype(np.float16).astype(np.float32).reshape(rows, -1)
    offset = (-dmin * mn).astype(np.float16).astype(np.float32).reshape(rows, -1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 2, 16)  # [super-block, sub-block, half, 16]
    codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale), torch.from_numpy(offset)


def as_q4_1(raw: np.ndarray, gguf_type: str, rows: int) -> tuple[torch.Tensor, ...]:
    """The raw bytes of a GGUF tensor of `rows` rows and a type in AS_Q4_1 -> Q4_1 arrays (codes, d, m)."""
    return {"Q4_1": q4_1_arrays, "Q4_0": q4_0_arrays, "Q4_K": _q4_k}[gguf_type](raw, rows)


def as_q8_0(raw: np.ndarray, gguf_type: str, rows: int) -> tuple[torch.Tensor, ...]:
    """The raw bytes of a quantized GGUF tensor of `rows` rows -> Q8_0 arrays (codes, d): as stored for Q8_0,
    else its values (gguf's dequantization) quantized by gguf's Q8_0 quantizer: 8 bits a value and a float16
    scale per 32, finer than the 2-6 bit source types it reads."""
    from gguf import GGMLQuantizationType, quants

    if gguf_type == "Q8_0":
        return q8_0_arrays(raw, rows)
    values = quants.dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(rows, -1)
    return quantize_q8_0(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))  # (gguf's, below)


def _unpermute_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """loader._unpermute_rope on rows of any trailing shape (a row's blocks move with it)."""
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _sources(cfg: ModelConfig, tensors: dict) -> dict[str, list[tuple[str, int | None]]]:
    """Our linear name (and "embed" for an untied embedding) -> its GGUF tensors in row order (of the file's
    `tensors`, by name), each with the head count whose rope rows it permutes."""
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
    if "output.weight" in tensors:  # an untied embedding: its own blocks (embedding_from_blocks)
        out["lm_head"], out["embed"] = [("output.weight", None)], [("token_embd.weight", None)]
    else:
        out["lm_head"] = [("token_embd.weight", None)]
    return out


def _read_as_blocks(tensors: dict, names: list[tuple[str, int | None]]) -> bool:
    """Whether the tensors `names` are all in the file and quantized (F32 / F16 / BF16: a file that asks for full
    precision keeps it)."""
    return all(name in tensors and tensors[name].tensor_type.name in QUANTIZED for name, _ in names)


def _blocks(tensors: dict, names: list[tuple[str, int | None]]) -> Blocks | None:
    """The blocks of the tensors `names` concatenated along rows, as Q4_1 where every one reads as Q4_1 blocks
    (`as_q4_1`), else as Q8_0 (`as_q8_0`); None where they cannot be read as blocks (`_read_as_blocks`)."""
    if not _read_as_blocks(tensors, names):
        return None
    parts = [tensors[name] for name, _ in names]
    kind = "q4_1" if all(t.tensor_type.name in AS_Q4_1 for t in parts) else "q8_0"
    read = as_q4_1 if kind == "q4_1" else as_q8_0
    pieces = []
    for t, (name, heads) in zip(parts, names, strict=True):
        arrays = read(np.asarray(t.data), t.tensor_type.name, int(t.shape[-1]))
        if not all(bool(torch.isfinite(scales).all()) for scales in arrays[1:]):  # (the kernels take no NaN scale)
            raise ModelFormatError(f"tensor {name} holds NaN or infinite values (a damaged file)")
        pieces.append([_unpermute_rows(a, heads) if heads else a for a in arrays])
    source = "+".join(sorted({t.tensor_type.name for t in parts}))
    return Blocks(kind, tuple(torch.cat(column).contiguous() for column in zip(*pieces, strict=True)), source)


def read_blocks(model: Transformer, gguf_path: Path, progress: Progress | None = None) -> dict[str, Blocks]:
    """{linear name: its Blocks} for the model's linears that the GGUF file stores quantized. `progress` hears
    ("reading CPU weight blocks", linears done, linears): a K-quant file's first load converts for seconds (a
    1B-parameter one: ~10 s)."""
    tensors = {t.name: t for t in gguf_reader(gguf_path).tensors}
    sources = _sources(model.cfg, tensors)
    found = {}
    # numpy and torch release the GIL in their array work, so the linears convert on every core at once
    with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
        futures = {pool.submit(_blocks, tensors, names): name for name, names in sources.items()}
        for i, future in enumerate(as_completed(futures)):
            try:
                found[futures[future]] = future.result()
            except ModelFormatError as exc:  # (what a file's damaged blocks say, naming the file)
                raise ModelFormatError(f"{gguf_path}: {exc}") from None
            if progress:
                progress(BLOCKS_STAGE, i + 1, len(sources))
    return {name: found[name] for name in sources if found[name] is not None}


def deferred_tensors(cfg: ModelConfig, tensors: dict) -> set[str]:
    """The GGUF tensors `pack_blocks` will read as blocks, which the loader need not dequantize (loader.load_gguf's
    `defer`): every linear's and the embedding's (`embedding_from_blocks`)."""
    groups = _sources(cfg, tensors).values()
    return {name for names in groups if _read_as_blocks(tensors, names) for name, _ in names}


def _save(cache: Path, blocks: dict[str, Blocks]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {f"{name}.{i}": t for name, b in blocks.items() for i, t in enumerate(b.arrays)}
    partial = cache.with_suffix(f".partial-{os.getpid()}")
    try:
        metadata = {name: f"{b.kind} {b.source}" for name, b in blocks.items()} | {"__format__": CACHE_FORMAT}
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, cache)
    except (OSError, SafetensorError) as exc:  # a full disk, a read-only folder: packed again at the next load
        note_not_saved(log, cache, exc)
        with suppress(OSError):  # NotADirectoryError where the folder is a file
            partial.unlink(missing_ok=True)


def _load(cache: Path) -> dict[str, Blocks] | None:
    from safetensors import safe_open

    try:
        with safe_open(str(cache), "pt") as f:
            kinds, keys = dict(f.metadata() or {}), set(f.keys())
            if kinds.pop("__format__", None) != CACHE_FORMAT:
                return None
            out = {}
            for name, value in kinds.items():
                kind, _, source = value.partition(" ")  # "q4_1 Q4_K"
                count = 3 if kind == "q4_1" else 2
                if any(f"{name}.{i}" not in keys for i in range(count)):
                    return None
                arrays = tuple(f.get_tensor(f"{name}.{i}") for i in range(count))
                out[name] = Blocks(kind, arrays, source)
            return out
    except Exception:  # safetensors raises its own error types on damaged files; the cache is rebuilt
        return None


def pack_blocks(
    model: Transformer, gguf_path: Path, cache: Path | None = None, progress: Progress | None = None
) -> int:
    """Re-class the model's linears that the GGUF file stores quantized (float32 model only) as block linears
    (Q4_1 or Q8_0 blocks: `_blocks`), and read a deferred embedding from blocks (`embedding_from_blocks`);
    returns how many linears. The float weights stay (large batches and `unpack` use them), but for those the
    loader deferred (meta tensors: `deferred_tensors`), which `.weight` then reads from the blocks. With `cache`
    (a safetensors path) the blocks are read from the file once (parsing a GGUF takes seconds; `progress`: see
    read_blocks) and from the cache after."""
    if not cpu_gemv.available() or next(model.parameters()).dtype != torch.float32:
        return 0
    blocks = _load(cache) if cache is not None and cache.exists() else None
    if blocks is None:
        blocks = read_blocks(model, gguf_path, progress)
        if cache is not None:  # then read back: blocks mapped from the file, whose pages int8 rows can give back
            _save(cache, blocks)
            blocks = (_load(cache) if cache.exists() else None) or blocks
    packed = 0
    modules = dict(model.named_modules())
    for name, (kind, arrays, source) in blocks.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear) or isinstance(linear, BlockLinear) or kind not in ("q4_1", "q8_0"):
            continue
        if arrays[0].shape[0] != linear.out_features or arrays[1].shape[1] * 32 != linear.in_features:
            continue
        as_block_linear(linear, kind, arrays).source = source
        if linear._parameters["weight"].is_meta:  # deferred by the loader: `.weight` reads the blocks' values
            del linear._parameters["weight"]
        packed += 1
    embedding_from_blocks(model, blocks)
    return packed


def block_values(
    module: nn.Module, index: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values of a module's GGUF blocks (its `kind` and buffers: Q4_1 codes, d, m or Q8_0 codes, d), of its rows
    `index` if given, in `dtype`: gguf's dequantization (kernels/cpu_gemv.py)."""
    codes, d, m = (module._buffers.get(name) for name in ("codes", "d", "m"))
    if index is not None:
        codes, d, m = codes[index], d[index], None if m is None else m[index]
    values = cpu_gemv.q4_dequantize(codes, d, m) if module.kind == "q4_1" else cpu_gemv.q8_dequantize(codes, d)
    return values if dtype == torch.float32 else values.to(dtype)


class BlockEmbedding(TiedEmbedding):
    """A token embedding read from its own GGUF blocks (an untied file's `token_embd`, which the loader deferred:
    `deferred_tensors`): a lookup dequantizes the rows it needs, as a tied one reads its head's (TiedEmbedding, of
    which it is its own head). The blocks are this module's buffers, counted as the model's weights."""

    def __init__(self, blocks: Blocks) -> None:
        kind, arrays, source = blocks
        nn.Module.__init__(self)
        self.kind, self.source, self.dtype = kind, source, torch.float32
        self.num_embeddings, self.embedding_dim = arrays[0].shape[0], arrays[1].shape[1] * cpu_gemv.BLOCK
        for name, value in zip(("codes", "d", "m"), arrays, strict=False):
            self.register_buffer(name, value, persistent=False)
        object.__setattr__(self, "head", self)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [R] of the table, [R, hidden] in `dtype`."""
        return block_values(self, index, dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole table [V, hidden] in `dtype`, made on each call."""
        return block_values(self, dtype=dtype)


def embedding_from_blocks(model: Transformer, blocks: dict[str, Blocks]) -> bool:
    """Where the loader deferred the embedding (a large file: `deferred_tensors`), it reads its rows from blocks
    (a lookup dequantizes the rows it needs), so its float32 table is never made (a Llama 3.2 1B's tied one: 1 GB,
    a Llama 3.1 8B's: 2 GB): a tied one from the output head's (TiedEmbedding), an untied one from its own
    (BlockEmbedding). A table the loader made stays: mapped from the float cache it costs only the rows read, and
    the heads' chain reads it in place. Returns whether it did."""
    head, embed = model.lm_head, model.embed
    if not (isinstance(embed, nn.Embedding) and embed.weight.is_meta):
        return False
    if model.cfg.tie_embeddings and isinstance(head, BlockLinear):
        model.embed = TiedEmbedding(head, torch.float32)
        return True
    own = blocks.get("embed")
    if own is None or own.arrays[0].shape[0] != embed.num_embeddings:
        return False  # (the loader's caller names the tensor left unread)
    model.embed = BlockEmbedding(own)
    return True


def as_block_linear(linear: nn.Linear, kind: str, blocks: tuple[torch.Tensor, ...]) -> BlockLinear:
    """Re-class `linear` in place to read GGUF `blocks` of its weight ("q4_1": codes, d, m; "q8_0": codes, d)."""
    linear.__class__ = BlockLinear
    linear.kind = kind
    linear.source = kind.upper()
    for buffer, value in zip(("codes", "d", "m"), blocks, strict=False):
        linear.register_buffer(buffer, value, persistent=False)
    return linear


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> its Q8_0 blocks as pack_blocks holds a GGUF file's (codes int8 [N, K], d float32 [N, K/32]):
    gguf's own quantizer (d = max|w| / 127 per block of 32, as float16), its bytes read as `read_blocks` reads."""
    from gguf import GGMLQuantizationType, quants

    raw = quants.quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return q8_0_arrays(raw, weight.shape[0])


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
