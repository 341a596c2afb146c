"""GPTQ on the MXFP4 grid: error-compensating quantization of a model's linear layers from calibration text.

GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers")
quantizes the weight W [N, K] of a layer y = x W^T one input column at a time and, after each column, spreads
that column's rounding error over the columns not yet quantized so that the layer's output on calibration
inputs X [T, K] changes least. The proxy loss is ||X W^T - X Q^T||^2, whose Hessian in each row of W is
H = 2 X^T X; with U the upper Cholesky factor of H^-1, quantizing column j and updating the rest by

    W[:, j+1:] -= (W[:, j] - Q[:, j]) / U[j, j] * U[j, j+1:]

is the optimal (OBS) compensation. Columns are processed in chunks of `CHUNK_COLUMNS` with the updates to
later chunks applied once per chunk (the paper's "lazy batch" trick); the result is the same.

What changes for MXFP4 (OCP MX v1.0): a block of 32 consecutive columns shares one E8M0 scale per row. When
the sweep reaches a block, its scale is fixed from the block's current, already error-compensated weights,
choosing per row the exponent with the least squared rounding error (rule "mse" of kernels.mxfp4; "ocp" and
"roundup" are selectable). The encoder changes, the format does not: the result is plain OCP MXFP4.

Options beyond the paper's defaults, each measured in docs/benchmarks.md:
- `damp`: the diagonal dampening, as a fraction of the mean diagonal of H (the paper uses 0.01).
- `act_order`: quantize the columns with the largest H diagonal first (the paper's "act-order"), here by block:
  blocks of 32 in descending order of their summed diagonal, and columns inside a block likewise, so that every
  block's scale is still chosen when the sweep first enters it.
- `rotate`: quantize W R against R^T H R, R = blockdiag(H_32 / sqrt(32)) (quant.fp4_linear.RotatedFp4Linear
  runs the result as (x R)(W R)^T); the layer's function is unchanged, its blocks lose their outliers.

`calibrate` runs the model block by block over the calibration tokens, as the GPTQ code does: each block's
Hessians are measured on inputs that already flow through the quantized blocks before it. It works on a twin of
each block (new modules sharing the block's tensors), so the model itself is never touched: an engine may keep
running it on another thread while the calibration runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specchat.config import CALIBRATION_TOKENS, DEFAULT_DAMP
from specchat.kernels.cpu_build import KERNEL_CACHES
from specchat.kernels.mxfp4 import (
    BLOCK_SIZE,
    E2M1_MAGNITUDES,
    E2M1_MIDPOINTS,
    dequantize_mxfp4,
    pack_nibbles,
    padded_k,
    quantize_mxfp4,
    round_to_e2m1,
    scales_to_float,
)
from specchat.quant.fp4_linear import rotate_blocks
from specchat.quant.modules import model_dtype

if TYPE_CHECKING:  # annotations only: the engine imports this package, never the other way round
    from specchat.engine.model import Block, Transformer

CALIBRATION_TEXT = "calibration_heapq.txt"  # specchat/data/text; a different text from the held-out one
CALIBRATION_SEQ_LEN = 1024  # tokens per calibration sequence (the perplexity tool's default context)
CHUNK_COLUMNS = 128  # columns per lazy-batch chunk (a multiple of BLOCK_SIZE)

Progress = Callable[[str, int, int], None]


@dataclass(slots=True)
class GptqSettings:
    """How `gptq_quantize` encodes one layer."""

    rule: str = "mse"
    damp: float = DEFAULT_DAMP
    act_order: bool = False
    rotate: bool = False  # quantize W R, R = blockdiag(Hadamard 32 / sqrt 32); the layer must then see x R

    def __post_init__(self) -> None:
        if self.damp <= 0:
            raise ValueError(f"damp must be > 0, got {self.damp}")


class HessianAccumulator:
    """Running H = 2/T * sum over calibration tokens of x x^T for one layer's input x [K]."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.hessian: torch.Tensor | None = None  # [K, K] float64, on the inputs' device
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.k).to(torch.float64)  # [T, K]
        product = 2 * x.T @ x
        self.hessian = product if self.hessian is None else self.hessian + product
        self.tokens += x.shape[0]

    def result(self) -> torch.Tensor:
        return self.hessian / max(self.tokens, 1)


def _inverse_hessian_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, so that H^-1 = U^T U."""
    h = hessian.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def _block_scales(block: torch.Tensor, rule: str) -> torch.Tensor:
    """Per-row E8M0 scale codes [N] for one block of 32 columns [N, 32]."""
    _, scales = quantize_mxfp4(block, rule=rule)  # [N, 1]
    return scales[:, 0]


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, settings: GptqSettings | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] + H [K, K] -> MXFP4 (codes uint8 [N, Kp/2], scales uint8 [N, Kp/32]), Kp = K padded to 32."""
    settings = settings or GptqSettings()
    n, k = weight.shape
    kp = padded_k(k)
    w = torch.nn.functional.pad(weight.float(), (0, kp - k))  # [N, Kp]
    h = torch.nn.functional.pad(hessian.to(torch.float64), (0, kp - k, 0, kp - k))  # [Kp, Kp]

    dead = h.diagonal() == 0  # inputs never active in calibration (and the padding): no error to compensate
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    perm = _column_order(h, settings.act_order)  # [Kp]; blocks of 32 stay contiguous
    w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_hessian_cholesky(h, settings.damp).float()  # [Kp, Kp]; factored in float64

    grid = torch.tensor(E2M1_MAGNITUDES, device=w.device)  # [8]
    midpoints = torch.tensor(E2M1_MIDPOINTS, device=w.device)  # [7]
    q = torch.zeros_like(w)  # quantized values, permuted order
    scale_codes = torch.zeros(n, kp // BLOCK_SIZE, dtype=torch.uint8, device=w.device)  # [N, blocks], permuted
    for c0 in range(0, kp, CHUNK_COLUMNS):
        c1 = min(c0 + CHUNK_COLUMNS, kp)
        w_chunk = w[:, c0:c1].clone()  # [N, C]
        err_chunk = torch.zeros_like(w_chunk)
        u_chunk = u[c0:c1, c0:c1]
        for j in range(c1 - c0):
            col = c0 + j
            if col % BLOCK_SIZE == 0:
                # the block's scale, from its weights as updated by every error compensated so far
                codes = _block_scales(w_chunk[:, j : j + BLOCK_SIZE], settings.rule)
                scale_codes[:, col // BLOCK_SIZE] = codes
                scale = scales_to_float(codes)  # [N]
            v = w_chunk[:, j] / scale  # [N], on the E2M1 scale
            # nearest grid value (saturating at 6; exact ties, which have measure zero, round down)
            q[:, col] = grid[torch.bucketize(v.abs(), midpoints)].copysign(v) * scale
            err_chunk[:, j] = (w_chunk[:, j] - q[:, col]) / u_chunk[j, j]
            w_chunk[:, j:].addr_(err_chunk[:, j], u_chunk[j, j:], alpha=-1)  # OBS update of this chunk
        w[:, c1:] -= err_chunk @ u[c0:c1, c1:]  # lazy update of the later chunks

    inverse = torch.argsort(perm)
    block_inverse = inverse[::BLOCK_SIZE] // BLOCK_SIZE  # original block b sits at permuted block block_inverse[b]
    q = q[:, inverse]  # [N, Kp], original column order
    scale_codes = scale_codes[:, block_inverse]  # [N, Kp/32]
    scale = scales_to_float(scale_codes).repeat_interleave(BLOCK_SIZE, dim=1)  # [N, Kp]
    codes = round_to_e2m1(q / scale)  # exact: q lies on each block's grid
    return pack_nibbles(codes), scale_codes


def _column_order(h: torch.Tensor, act_order: bool) -> torch.Tensor:
    """The order GPTQ visits columns in: natural, or act-order kept block-contiguous (see the module doc)."""
    kp = h.shape[0]
    if not act_order:
        return torch.arange(kp, device=h.device)
    diag = h.diagonal().reshape(kp // BLOCK_SIZE, BLOCK_SIZE)  # [blocks, 32]
    block_order = torch.argsort(diag.sum(dim=1), descending=True, stable=True)
    within = torch.argsort(diag, dim=1, descending=True, stable=True)  # [blocks, 32]
    return (block_order[:, None] * BLOCK_SIZE + within[block_order]).reshape(-1)


# --- whole-model calibration ---------------------------------------------------------------------------------
def calibration_text() -> str:
    return resources.files("specchat").joinpath("data", "text", CALIBRATION_TEXT).read_text()


def calibration_sequences(
    ids: Sequence[int], tokens: int = CALIBRATION_TOKENS, seq_len: int = CALIBRATION_SEQ_LEN
) -> list[torch.Tensor]:
    """The first `tokens` token ids cut into sequences of at most `seq_len` ([L] int64 each)."""
    ids = torch.tensor(list(ids[:tokens]), dtype=torch.long)
    return list(ids.split(seq_len))


class _DenseCausalKV:
    """KVAttention for one calibration sequence run all at once: plain causal attention, no cache."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]: causal grouped-query attention over the sequence."""
        heads_first = [t.transpose(0, 1) for t in (q, k, v)]  # [heads, T, D]
        out = F.scaled_dot_product_attention(*heads_first, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.transpose(0, 1)


def _run_block(block: nn.Module, model: Transformer, hidden: list[torch.Tensor], positions: torch.Tensor) -> list:
    kv = _DenseCausalKV(model.cfg.head_dim**-0.5)
    outputs = []
    for x in hidden:
        cos, sin = model.rope(positions[: x.shape[0]])
        outputs.append(block(x, cos, sin, kv))
    return outputs


def _twin(block: Block) -> nn.Module:
    """New modules over the same tensors: weights can be rebound and hooks added without touching `block`. The CPU
    kernels' bindings of a block's tensors (ctypes views, which cannot be copied) are left out of the twin, whose
    modules bind their own at first use."""
    shared = {id(t): t for t in (*block.parameters(), *block.buffers())}
    for module in block.modules():
        for key in KERNEL_CACHES:
            if key in module.__dict__:
                shared[id(module.__dict__[key])] = None
    return copy.deepcopy(block, shared)


@torch.inference_mode()
def calibrate(
    model: Transformer,
    sequences: Sequence[torch.Tensor],
    names: Sequence[str],
    settings: GptqSettings | None = None,
    progress: Progress | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ-quantize the linears `names` (module names) of `model` over calibration token sequences.

    Block by block: one pass measures the Hessians of the block's chosen linears on inputs that already flow
    through the quantized blocks before it; a second pass, with this block's weights quantized, makes the next
    block's inputs. Returns {name: (codes, scales)} in the interchange layout, on the CPU. The model is not
    modified (see the module docstring); `progress` hears ("GPTQ", linears done, linears chosen).
    """
    settings = settings or GptqSettings()
    wanted = set(names)
    device = next(model.parameters()).device
    dtype = model_dtype(model)  # (a tied embedding reading the head's blocks makes its whole table for .weight)
    positions = torch.arange(max(len(s) for s in sequences), device=device)
    hidden = [model.embed(s.to(device)) for s in sequences]  # per sequence [L, hidden]
    result: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def quantize(name: str, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
        """GPTQ of one weight [N, K]; returns the values it now stands for, in the model dtype."""
        weight = weight.float()
        if settings.rotate:  # x W^T = (x R)(W R)^T: quantize W R against the Hessian of x R, R^T H R
            weight, hessian = rotate_blocks(weight), rotate_blocks(rotate_blocks(hessian).T).T
        codes, scales = gptq_quantize(weight, hessian, settings)
        result[name] = (codes.cpu(), scales.cpu())
        if progress:
            progress("GPTQ", len(result), len(wanted))
        fake = dequantize_mxfp4(codes, scales, torch.float32, k=weight.shape[1])
        return (rotate_blocks(fake) if settings.rotate else fake).to(dtype)

    for i, block in enumerate(model.layers):
        twin = _twin(block)
        targets = {n: m for n, m in twin.named_modules() if f"layers.{i}.{n}" in wanted}
        accumulators = {n: HessianAccumulator(m.in_features) for n, m in targets.items()}
        hooks = [
            m.register_forward_hook(lambda _m, args, _out, acc=accumulators[n]: acc.add(args[0]))
            for n, m in targets.items()
        ]
        _run_block(twin, model, hidden, positions)
        for hook in hooks:
            hook.remove()
        for n, module in targets.items():
            module.weight = nn.Parameter(quantize(f"layers.{i}.{n}", module.weight, accumulators[n].result()))
        hidden = _run_block(twin, model, hidden, positions)
    if "lm_head" in wanted:
        acc = HessianAccumulator(model.cfg.hidden_size)
        for x in hidden:
            acc.add(model.norm(x))
        quantize("lm_head", model.lm_head.weight, acc.result())
    return result
