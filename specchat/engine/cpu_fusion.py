"""The CPU kernels of kernels/cpu_ops.py and cpu_block.py as a transform of the model (docs/style.md #3, #6).

`fuse(model)` re-classes a float32 CPU model's `Block`, `RMSNorm`, `Rotary` and `SiluAndMul` modules
(engine/model.py) as the subclasses below, whose forward calls one C kernel where the plain one runs a chain of
torch ops; `CpuBlock` also adds each residual in the same pass as the norm that follows it. Attention goes through
the KV batch, which takes the C paged-attention kernel (kernels/cpu_attention.py) when its pool was built with
`cpu_kernels` (engine/kv_batch.py); where it does and every linear of a block reads GGUF blocks, `CpuBlock` runs
the whole block as one C call. `unfuse(model)` swaps the plain modules back; parameters and state stay the same
objects. `--eager` never fuses (engine/loading.py): that is the reference the tests hold this path to.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specchat.engine.cpu_weights import BlockLinear
from specchat.engine.fusion import swap_classes
from specchat.engine.kv_batch import KVBatch
from specchat.engine.model import Block, KVAttention, RMSNorm, Rotary, SiluAndMul, Transformer
from specchat.kernels import cpu_block, cpu_ops


class CpuRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.supported(x):
            return super().forward(x)
        return cpu_ops.rms_norm(x.contiguous(), self.weight, self.eps)


class CpuRotary(Rotary):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not cpu_ops.supported(q):
            return super().forward(q, k, cos, sin)
        return cpu_ops.rope_qk(q, k, cos, sin)


class CpuSiluAndMul(SiluAndMul):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not cpu_ops.supported(gate_up):
            return super().forward(gate_up)
        return cpu_ops.silu_mul(gate_up.contiguous())


class CpuBlock(Block):
    """Block with the attention's residual add and the MLP's norm in one kernel: x + attn(norm(x)) -> (s,
    norm(s)) in one pass over the row. Where every linear reads GGUF blocks and the step attends in C, the whole
    block is one call (kernels/cpu_block.py, the same kernels in the same order: the same bits as `forward_ops`)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        if not cpu_ops.supported(x):
            return super().forward(x, cos, sin, kv)
        call = self.one_call(x.numel() // x.shape[-1], kv)
        if call is None:
            return self.forward_ops(x, cos, sin, kv)
        weights, (plan, k_pages, v_pages, rotation) = call
        return cpu_block.decode_block(
            weights, plan, x.contiguous(), cos, sin, k_pages, v_pages, torch.get_num_threads(), rotation
        )

    def one_call(self, rows: int, kv: KVAttention) -> tuple[cpu_block.BlockWeights, tuple] | None:
        """(bound weights, the step's pages for this layer: KVBatch.cpu_pages) where this block runs as one C call
        over `rows` float32 rows, else None (the attention is not the CPU kernel's, a linear does not read GGUF
        blocks, or the rows are a long prompt's, where the float GEMM is faster)."""
        attn = self.attn
        if not isinstance(kv, KVBatch):
            return None
        pages = kv.cpu_pages(attn.layer, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        weights = self.block_weights() if pages is not None else None
        if weights is None or self._modules["mlp"]._modules["w_gate_up"].takes_gemm(rows):
            return None
        return weights, pages

    def block_weights(self) -> cpu_block.BlockWeights | None:
        """The block's weights bound for kernels/cpu_block.py, or None where a linear is not a BlockLinear (HF
        weights, MXFP4) or has a bias other than q/k/v's. Bound once and kept while the same tensors are in place:
        the check is the ids of the tensors it reads (alive while kept, so an id cannot be reused by a new one),
        ~2 us a call where reading them through the modules' attributes took ~20."""
        attn, mlp = self._modules["attn"], self._modules["mlp"]
        linears = (attn._modules["wqkv"], attn._modules["wo"], mlp._modules["w_gate_up"], mlp._modules["w_down"])
        norms = (self._modules["attn_norm"]._parameters["weight"], self._modules["mlp_norm"]._parameters["weight"])
        state = (*(m._buffers.get("codes") for m in linears), *norms, *(m._parameters.get("bias") for m in linears))
        state += tuple(type(m) for m in linears)  # BlockLinear or Int8BlockLinear: which kernels read the blocks
        key = tuple(map(id, state))
        cached = self.__dict__.get("_block_weights")
        if cached is not None and cached[0] == key:
            return cached[1]
        weights = None
        plain = all(isinstance(m, BlockLinear) for m in linears) and all(m.bias is None for m in linears[1:])
        if plain and cpu_block.available() and self.attn_norm.eps == self.mlp_norm.eps:
            weights = cpu_block.BlockWeights(
                *(m.bound() for m in linears), *norms, self.mlp_norm.eps, attn.q_size, attn.kv_size, linears[0].bias
            )
        self.__dict__["_block_weights"] = (key, weights, state)  # state: keeps the tensors whose ids make the key
        return weights

    def forward_ops(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        """The block one kernel call at a time (any linear modules, any KV attention)."""
        norm = self.mlp_norm
        delta = self.attn(self.attn_norm(x), cos, sin, kv).contiguous()
        x, h = cpu_ops.add_rms_norm(x.contiguous(), delta, norm.weight, norm.eps)
        return x + self.mlp(h)


class CpuTransformer(Transformer):
    """Transformer whose blocks run in one C call (kernels/cpu_block.py `decode_layers`) where each would run as one
    (`CpuBlock.one_call`): the Python between blocks is left out (default model, int8 rows, 2 threads: a decode step
    4.07 -> 3.36 ms; docs/benchmarks.md, "Fifteenth session"). Otherwise the blocks one by one."""

    def run_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention, taps: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        layers, rows = self._modules["layers"], x.numel() // x.shape[-1]
        calls = []
        for block in layers if cpu_ops.supported(x) else ():
            call = block.one_call(rows, kv) if isinstance(block, CpuBlock) else None
            if call is None:  # (a long prompt's rows: the first block says so, the others are not asked)
                break
            calls.append(call)
        if not calls or len(calls) < len(layers):
            return super().run_blocks(x, cos, sin, kv, taps)
        plan = calls[0][1][0]
        assert all(pages[0] is plan for _, pages in calls), "one plan per step"
        weights, pages = [w for w, _ in calls], [pages[1:] for _, pages in calls]
        return cpu_block.decode_layers(weights, plan, x.contiguous(), cos, sin, pages, taps, torch.get_num_threads())


FUSED = {
    Transformer: CpuTransformer,
    Block: CpuBlock,
    RMSNorm: CpuRMSNorm,
    Rotary: CpuRotary,
    SiluAndMul: CpuSiluAndMul,
}
PLAIN = {fused: plain for plain, fused in FUSED.items()}


def fuse(model: nn.Module) -> int:
    """Use the CPU kernels in a float32 CPU model (none where they do not load); returns the modules swapped."""
    param = next(model.parameters())
    if param.dtype != torch.float32 or param.device.type != "cpu" or not cpu_ops.available():
        return 0
    return swap_classes(model, FUSED)


def unfuse(model: nn.Module) -> int:
    """Back to the plain PyTorch modules."""
    return swap_classes(model, PLAIN)
