"""Fp4Linear: a drop-in for nn.Linear whose weight lives only as MXFP4 (OCP MX v1.0) codes and scales.

The module's resident tensors are the packed E2M1 codes (two per byte) and the E8M0 block scales (one per 32
weights), plus the bias if any: 4.25 bits per weight. `forward` is `kernels.mxfp4_matmul.mxfp4_linear`: the
Triton dequant-matmul on CUDA (codes and scales in the kernel's layout, made once by `prepare_weight`), and on
the CPU a dequantization into a scratch buffer shared by all layers followed by F.linear, so no dense copy of
the weight outlives a call; except that on the CPU a step's few rows (up to cpu_gemv.MAX_ROWS) go through a C
kernel reading the codes as stored (`cpu_gemv.fp4_gemm`, bound once by `bound`; docs/mxfp4.md). With int8
activation rows (`set_activations("int8")`, `--cpu-act int8`: the engine's default where the CPU has AVX512-VNNI or
AVX2) the codes and scales are repacked, in place of the interchange ones, for cpu_gemv_i8's MXFP4 x int8 kernel,
which then takes every row count on the CPU.

`RotatedFp4Linear` stores W R instead of W, with R = blockdiag(H_32 / sqrt(32)) the orthonormal 32-point
Hadamard transform of each block of 32 inputs, and computes (x R)(W R)^T = x W^T. Rotating a block spreads its
outliers over all 32 elements before they share one power-of-two scale, which MXFP4 rounds far better (the
micro-rotation of MR-GPTQ, Egiazarian et al. 2025, "Bridging the Gap Between Promise and Performance for
Microscaling FP4 Quantization"). The cost is one [T, K/32, 32] x [32, 32] matmul on the input per layer (in the
CPU kernel a 32-point fast Walsh-Hadamard transform of each block).

`TiedEmbedding` is the token embedding of a model whose tied output head is an Fp4Linear (or, on the CPU, reads a
GGUF file's blocks): it looks rows up in the head's codes and dequantizes only those, so the tied matrix is held
once, as the head holds it.
"""

from __future__ import annotations

import torch
from torch import nn

from specchat.kernels import cpu_gemv, cpu_gemv_i8
from specchat.kernels.mxfp4 import BLOCK_SIZE, Rule, dequantize_mxfp4, quantize_mxfp4, rotate_blocks
from specchat.kernels.mxfp4_layout import gather_rows
from specchat.kernels.mxfp4_matmul import Mxfp4Weight, mxfp4_linear, prepare_weight, unprepare_weight


class Fp4Linear(nn.Module):
    """y = x @ dequant(W)^T + b with W [out_features, in_features] held as MXFP4 only."""

    def __init__(
        self, weight: Mxfp4Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.k, weight.n
        self.dtype = dtype  # of the model around it: what `weight` dequantizes to
        self.register_buffer("codes", weight.codes)  # CPU: uint8 [N, Kp/2]; CUDA: the kernel's int32 words
        self.register_buffer("scales", weight.scales)  # CPU: uint8 [N, Kp/32]; CUDA: the kernel's layout
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._layout = (weight.prepared, weight.exp_offset, weight.has_nan)

    @classmethod
    def from_packed(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Fp4Linear:
        """From interchange codes uint8 [N, Kp/2] and scales uint8 [N, Kp/32], laid out for their device."""
        return cls(prepare_weight(codes, scales, k=in_features), bias, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rule: Rule = "mse") -> Fp4Linear:
        """Round-to-nearest quantization of a dense Linear (on its device)."""
        codes, scales = quantize_mxfp4(linear.weight.detach(), rule=rule)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_packed(codes, scales, linear.in_features, bias, linear.weight.dtype)

    @property
    def weight_mxfp4(self) -> Mxfp4Weight:
        """The packed weight as the matmul reads it (a view of this module's buffers; a copy in the interchange
        layout where they are the int8 kernel's)."""
        prepared, exp_offset, has_nan = self._layout
        codes, scales = self.packed() if self.int8_rows else (self.codes, self.scales)
        return Mxfp4Weight(self.out_features, self.in_features, codes, scales, prepared, exp_offset, has_nan)

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Interchange (codes uint8 [N, Kp/2], scales uint8 [N, Kp/32]), e.g. to save a checkpoint."""
        if self.int8_rows:
            return cpu_gemv_i8.unpack_fp4(self.codes, self.scales, self.out_features)
        return unprepare_weight(self.weight_mxfp4)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values [N, K] in `dtype` (exact in float32: every MXFP4 value is a float32)."""
        codes, scales = self.packed()
        return dequantize_mxfp4(codes, scales, dtype, k=self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] in the model dtype, made anew on each access: for code that reads a
        linear's weight (drafters that share the output head), never for running the layer."""
        return self.dequantized(self.dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [R] of the weight, dequantized: [R, K] in `dtype` (an embedding lookup)."""
        if self.int8_rows:
            return cpu_gemv_i8.fp4_rows(self.codes, self.scales, index).to(dtype)  # (K: whole blocks)
        codes, scales = gather_rows(self.weight_mxfp4, index)
        return dequantize_mxfp4(codes, scales, torch.float32, k=self.in_features).to(dtype)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """A dense nn.Linear holding the dequantized weight."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.dequantized(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    @property
    def nbytes(self) -> int:
        """Resident bytes of the packed weight (codes + scales, with any kernel-layout padding)."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    rotated = False  # RotatedFp4Linear: the weight was quantized as W R, so x is rotated by R first
    int8_rows = False  # the CPU kernel's activation rows: float32, or int8 (set_activations; buffers repacked)

    @property
    def gemm_for_many_rows(self) -> bool:
        """Whether rows above cpu_gemv.MAX_ROWS take mxfp4_linear's dense GEMM (as BlockLinear's float rows do);
        the int8 kernel takes any number (as Int8BlockLinear's)."""
        return not self.int8_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequant(W)^T + b: on the CPU a step's few rows (up to cpu_gemv.MAX_ROWS) through the C kernel,
        which reads the codes as stored (cpu_gemv.fp4_linear: 4.25 bits a weight, float32 sums, a row's result
        whatever its batch; a rotated layer's rotation in it too), or with int8 rows any number of rows through
        cpu_gemv_i8's kernel; more float rows, and CUDA, through mxfp4_linear. A whole block of such layers runs as
        one C call (engine/cpu_fusion.CpuBlock, through `bound`)."""
        rows = x.numel() // self.in_features
        bound = None if x.is_cuda or self.takes_gemm(rows) else self.bound()
        if bound is None:
            return mxfp4_linear(rotate_blocks(x) if self.rotated else x, self.weight_mxfp4, self.bias)
        y = bound(x.reshape(rows, self.in_features).float().contiguous(), torch.get_num_threads())
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def takes_gemm(self, rows: int) -> bool:
        """Whether `rows` rows take mxfp4_linear's dense GEMM on the CPU rather than the kernel."""
        return self.gemm_for_many_rows and rows > cpu_gemv.MAX_ROWS

    def bound(self) -> cpu_gemv.Bound | cpu_gemv_i8.Fp4Bound | None:
        """The codes and scales bound for the CPU's MXFP4 kernel of the module's rows (again after they were
        replaced): cpu_gemv's (float rows) or cpu_gemv_i8's (int8 rows), or None where the float one cannot read
        them (no compiled kernels, the CUDA kernel's layout, a NaN block, K not whole blocks)."""
        codes = self.codes
        bound = self.__dict__.get("_cpu_bound")
        if bound is None or bound[0] != codes.data_ptr():
            if self.int8_rows:
                kernel = cpu_gemv_i8.Fp4Bound(codes, self.scales, self.out_features, rotate=self.rotated)
            else:
                ok = self._cpu_readable() and cpu_gemv.available()
                kernel = cpu_gemv.Bound(codes, self.scales, rotate=self.rotated) if ok else None
            bound = self.__dict__["_cpu_bound"] = (codes.data_ptr(), kernel)
        return bound[1]

    def _cpu_readable(self) -> bool:
        """Whether the CPU kernels can read the interchange codes (not the CUDA layout, no NaN block, whole blocks)."""
        prepared, _, has_nan = self._layout
        return not (prepared or has_nan or self.codes.is_cuda) and self.in_features % BLOCK_SIZE == 0

    def set_activations(self, activations: str) -> bool:
        """The CPU kernel's activation rows: "int8" (cpu_gemv_i8's MXFP4 x int8 kernel, for any number of rows; the
        codes and scales repacked for it in place of the interchange ones: the same bytes, no copy kept) or "fp32"
        (cpu_gemv's float kernel, the interchange layout back). Bound now, not in the first step. Returns whether
        the module multiplies with those rows: int8 needs cpu_gemv_i8.available() and codes the CPU kernels read."""
        assert activations in ("fp32", "int8"), activations
        int8 = activations == "int8"
        if int8 != self.int8_rows:
            if int8 and not (self._cpu_readable() and cpu_gemv_i8.available()):
                return False
            relaid = cpu_gemv_i8.repack_fp4(self.codes, self.scales) if int8 else self.packed()
            self.codes, self.scales = relaid  # (registered buffers: replaced in place)
            self.int8_rows = int8
        self.bound()
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RotatedFp4Linear(Fp4Linear):
    """An Fp4Linear whose packed weight is W R (see the module docstring); it rotates its input to match."""

    rotated = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, rule: Rule = "mse") -> RotatedFp4Linear:
        """Round-to-nearest quantization of W R for a dense Linear (on its device)."""
        codes, scales = quantize_mxfp4(rotate_blocks(linear.weight.detach()), rule=rule)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_packed(codes, scales, linear.in_features, bias, linear.weight.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The effective weight W = (W R) R [N, K] in `dtype`."""
        return rotate_blocks(super().dequantized(torch.float32)).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [R] of the effective weight: the stored rows of W R, times R."""
        return rotate_blocks(super().rows(index, torch.float32)).to(dtype)


class TiedEmbedding(nn.Module):
    """Token embedding tied to a quantized output head: row i is the head's row i, dequantized on lookup. The head
    is an MXFP4 one (Fp4Linear: quant/modules.mxfp4_modules) or, on the CPU, one reading a GGUF file's blocks
    (engine/cpu_weights.BlockLinear: `tie_embedding`); either has `rows(index, dtype)` and `dequantized(dtype)`.

    The head stays the model's `lm_head` module; this one only refers to it (it is not a submodule, so the model
    lists the head once, under its own name, and counts its bytes once).
    """

    def __init__(self, head: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        object.__setattr__(self, "head", head)  # a plain reference: nn.Module would register it as a child

    @property
    def weight(self) -> torch.Tensor:
        """The whole table [V, hidden] in the model dtype, made anew on each access (see Fp4Linear.weight)."""
        return self.head.dequantized(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden] in the model dtype."""
        return self.head.rows(ids.reshape(-1), self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the output head ({type(self.head).__name__})"


def embedding_pointer(embed: nn.Module) -> int:
    """Where the table a token embedding reads lives, without making one: a TiedEmbedding's `weight` dequantizes the
    whole table anew (a fresh pointer each time), so for it the head's codes."""
    head = getattr(embed, "head", None)
    if head is None:
        return embed.weight.data_ptr()
    codes = getattr(head, "codes", None)
    return codes.data_ptr() if isinstance(codes, torch.Tensor) else id(head)


def set_fp4_activations(model: nn.Module, activations: str) -> int:
    """`Fp4Linear.set_activations` on every Fp4Linear of `model` ("fp32" or "int8"); returns how many multiply with
    those rows. The engine's --cpu-act for MXFP4 weights, as engine/cpu_weights.set_activations is for GGUF blocks."""
    return sum(module.set_activations(activations) for module in model.modules() if isinstance(module, Fp4Linear))
