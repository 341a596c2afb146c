"""KV page formats: how a page stores numbers, and the Hadamard rotation applied before quantizing.

Formats (names are what `--kv` takes):
- "bf16" | "fp16" | "fp32": keys and values as they are.
- "mxfp4": keys and values in MXFP4 (OCP MX v1.0: E2M1 elements, one E8M0 scale per 32 along head_dim),
  4.25 bits per element: 73.4% less than bf16.
- "k8v4": keys in MXFP8 (E4M3 elements, same block scales; keys are the sensitive half: an error in a key
  moves every softmax weight of the query), values in MXFP4: 6.25 bits per element, 60.9% less than bf16.

Rotation (QuaRot, Ashkboos et al. 2024; QuIP#, Tseng et al. 2024): before quantizing, every head's keys and
values are multiplied by an orthonormal Hadamard matrix R (block-diagonal, blocks of the largest power of two
dividing head_dim). It spreads outlier channels over the whole block, so the shared scale fits the others
better. Queries are rotated alike, so scores are unchanged: (qR)(kR)^T = q k^T. Values come out rotated,
sum_j p_j v_j R, and the output is rotated back by R^T = R (a symmetric Sylvester matrix). Dense formats are
stored unrotated: there it would only cost time.

Key transform (optional, `key_transform`): before the rotation, each KV head's keys are multiplied by a calibrated
matrix A of its layer and the queries by A^-T, so scores are still unchanged: (q A^-T R)(k A R)^T = q k^T. Values
are untouched by it. A comes from kv_transform (calibrated once per model); KVPool uses it for "mxfp4" pages.
"""

from __future__ import annotations

import torch

from specchat.config import KV_FORMATS
from specchat.errors import ConfigError
from specchat.kernels.kv_quant import DEFAULT_RULE, DENSE, MXFP4, MXFP8, PageTensor, row_bytes
from specchat.kernels.mxfp4 import BLOCK_SIZE, hadamard

DENSE_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
QUANTIZED_FORMATS = {"mxfp4": (MXFP4, MXFP4), "k8v4": (MXFP8, MXFP4)}  # (key, value) element formats
PAGE_FORMATS = (*DENSE_FORMATS, *QUANTIZED_FORMATS)
KEY_TRANSFORM_FORMATS = ("mxfp4",)  # formats whose keys KVPool transforms (calibrated; k8v4 gained nothing from it)
assert set(PAGE_FORMATS) == set(KV_FORMATS), "config.KV_FORMATS names every page format, and only those"
CONVERT_CHUNK_SLOTS = 4096  # rows converted at once by a format switch (bounds its scratch memory)


def format_for_dtype(dtype: torch.dtype) -> str:
    """The dense page format of a model dtype."""
    return {v: k for k, v in DENSE_FORMATS.items()}[dtype]


def auto_format(dtype: torch.dtype, cpu_kernels: bool = False, head_dim: int = 0) -> str:
    """What "auto" pages are: the model dtype's dense format, except for a float32 model whose attention runs in
    the CPU's C kernel (a pool with `cpu_kernels`), which takes float16 pages: half the bytes a long context reads
    per token (a decode step 1.31x faster at 1,340 tokens, 1.33x at 2,632 on a 2-core CPU) and twice the context in the
    same memory, for +0.1% perplexity (docs/benchmarks.md, "Thirteenth session")."""
    if cpu_kernels and dtype == torch.float32:
        from specchat.kernels import cpu_attention

        if cpu_attention.supports(head_dim):
            return "fp16"
    return format_for_dtype(dtype)


def element_formats(fmt: str) -> tuple[str, str]:
    if fmt in DENSE_FORMATS:
        return DENSE, DENSE
    return QUANTIZED_FORMATS[fmt]


def bytes_per_token(fmt: str, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """KV bytes one token takes in every layer and KV head, block scales included."""
    k_fmt, v_fmt = element_formats(fmt)
    dtype = DENSE_FORMATS.get(fmt, torch.float32)
    per_head = row_bytes(k_fmt, head_dim, dtype) + row_bytes(v_fmt, head_dim, dtype)
    return num_layers * num_kv_heads * per_head


def hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rotation_matrix(head_dim: int) -> torch.Tensor:
    """Block-diagonal Hadamard [head_dim, head_dim], blocks of `hadamard_block(head_dim)`."""
    block = hadamard_block(head_dim)
    return torch.block_diag(*[hadamard(block)] * (head_dim // block))


class PageStore:
    """Keys and values of every layer in one page format: `PageTensor` rows [KVH, slots, ...] per layer."""

    def __init__(
        self,
        fmt: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        device: torch.device,
        rotate: bool = True,
        rule: str = DEFAULT_RULE,
        key_transform: torch.Tensor | None = None,
    ) -> None:
        if fmt in QUANTIZED_FORMATS and head_dim % BLOCK_SIZE:
            raise ConfigError(
                f"the {fmt} KV format needs a head_dim that is a multiple of 32; this model's is {head_dim}"
            )
        self.name = fmt
        self.rule = rule
        self.num_kv_heads, self.head_dim, self.num_slots, self.device = num_kv_heads, head_dim, num_slots, device
        self.k: list[PageTensor | None] = []
        self.v: list[PageTensor | None] = []
        # the token whose keys and values each slot holds (every forward writes them: `KVBatch.record`), so that a
        # drafter on the device reads a request's context through its page table (kernels/ngram.py)
        self.ids = torch.zeros(num_slots, dtype=torch.long, device=device)
        for _ in range(num_layers):
            self._add_layer()
        quantized = fmt in QUANTIZED_FORMATS
        self.rotation = rotation_matrix(head_dim).to(device) if quantized and rotate else None  # [D, D]
        self._rotation_in: dict[torch.dtype, torch.Tensor] = {}  # the rotation cast to each activation dtype
        self.key_transform = key_transform  # A [layers, KVH, D, D] or None
        self._kmat = self._qmat = self._kinv = None  # A R, A^-T R and R^T A^-1 (float32, on the device)
        self._cpu_rotations: dict[int, object] = {}  # layer -> cpu_attention.PageRotation
        if key_transform is not None:
            a = key_transform.double()
            r = (torch.eye(head_dim) if self.rotation is None else self.rotation.cpu()).double()
            inv = torch.linalg.inv(a)
            self._kmat, self._qmat, self._kinv = (m.float().to(device) for m in (a @ r, inv.mT @ r, r.T @ inv))

    def _add_layer(self) -> None:
        k_fmt, v_fmt = element_formats(self.name)
        dtype = DENSE_FORMATS.get(self.name, torch.float32)
        for rows, fmt in ((self.k, k_fmt), (self.v, v_fmt)):
            rows.append(
                PageTensor.empty(fmt, self.num_kv_heads, self.num_slots, self.head_dim, dtype, self.device, self.rule)
            )

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> x R (also R's inverse: R is symmetric and orthonormal); identity without rotation."""
        if self.rotation is None:
            return x
        if x.dtype not in self._rotation_in:
            self._rotation_in[x.dtype] = self.rotation.to(x.dtype)
        return x @ self._rotation_in[x.dtype]

    def rotate_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [T, KVH, D] -> k A R (k R without a key transform): what the pages store."""
        if self._kmat is None:
            return self.rotate(k)
        return torch.einsum("thd,hde->the", k.float(), self._kmat[layer]).to(k.dtype)

    def rotate_queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> q A^-T R, the A of each query head's KV head (q R without a key transform)."""
        if self._qmat is None:
            return self.rotate(q)
        qg = q.float().unflatten(1, (self.num_kv_heads, -1))  # [T, KVH, G, D]
        return torch.einsum("thgd,hde->thge", qg, self._qmat[layer]).flatten(1, 2).to(q.dtype)

    def unrotate_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """The inverse of rotate_keys: stored keys [T, KVH, D] -> the model's keys."""
        if self._kinv is None:
            return self.rotate(k)
        return torch.einsum("the,hed->thd", k.float(), self._kinv[layer]).to(k.dtype)

    def cpu_rotation(self, layer: int):
        """The CPU attention kernel's view of the matrices above for a layer (cpu_attention.PageRotation: the
        kernel rotates and quantizes the step's rows itself), built once a layer."""
        rotation = self._cpu_rotations.get(layer)
        if rotation is None:
            from specchat.kernels import cpu_attention

            q_mat, k_mat = (None, None) if self._kmat is None else (self._qmat[layer], self._kmat[layer])
            block, scale = 0, 1.0
            if self.rotation is not None:  # rotation_matrix's blocks, entries +-scale
                block, scale = hadamard_block(self.head_dim), float(self.rotation[0, 0])
            rotation = cpu_attention.PageRotation(q_mat, k_mat, block, scale, self.rule)
            self._cpu_rotations[layer] = rotation
        return rotation

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, KVH, D] (already rotated) at slots [T]."""
        self.k[layer].write(slots, k)
        self.v[layer].write(slots, v)

    def read(self, layer: int, index: torch.Tensor | slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [KVH, n, D] of the given slots, in dtype (still rotated)."""
        return self.k[layer].read(index, dtype), self.v[layer].read(index, dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for t in (*self.k, *self.v):
            t.copy_slots(src, dst)
        self.ids[dst] = self.ids[src]

    def reencode(
        self,
        fmt: str,
        num_slots: int,
        src: torch.Tensor,
        dst: torch.Tensor,
        rotate: bool = True,
        rule: str = DEFAULT_RULE,
        key_transform: torch.Tensor | None = None,
    ) -> PageStore:
        """A new store in format fmt holding rows src of this one at dst; this store is emptied layer by layer.

        Peak memory is about the larger of the two stores plus one layer, not both.
        """
        other = PageStore(fmt, 0, self.num_kv_heads, self.head_dim, num_slots, self.device, rotate, rule, key_transform)
        for layer in range(len(self.k)):
            other._add_layer()
            for lo in range(0, src.numel(), CONVERT_CHUNK_SLOTS):
                s, d = src[lo : lo + CONVERT_CHUNK_SLOTS], dst[lo : lo + CONVERT_CHUNK_SLOTS]
                k, v = self.read(layer, s, torch.float32)  # [KVH, n, D], in this store's basis
                k = other.rotate_keys(layer, self.unrotate_keys(layer, k.transpose(0, 1)))
                v = other.rotate(self.rotate(v)).transpose(0, 1)
                other.write(layer, d, k.contiguous(), v.contiguous())
            self.k[layer] = self.v[layer] = None
        other.ids[dst] = self.ids[src]
        return other
