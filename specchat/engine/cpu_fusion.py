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

import operator
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from specchat.engine.cpu_weights import Bf16Linear, BlockLinear
from specchat.engine.fusion import swap_classes
from specchat.engine.kv_batch import KVBatch
from specchat.engine.model import Block, KVAttention, Linear, RMSNorm, Rotary, SiluAndMul, Transformer
from specchat.kernels import cpu_block, cpu_gemv, cpu_ops
from specchat.quant.fp4_linear import Fp4Linear


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
        """The block's weights bound for kernels/cpu_block.py, or None where a linear is neither a BlockLinear nor
        an Fp4Linear the CPU kernel reads (HF weights) or has a bias other than q/k/v's. Bound once and kept while
        the same tensors are in place: the check is the ids of the tensors it reads (alive while kept, so an id
        cannot be reused by a new one), ~2 us a call where reading them through the modules' attributes took ~20."""
        state = self.weight_state()
        key = tuple(map(id, state))
        cached = self.__dict__.get("_block_weights")
        if cached is not None and cached[0] == key:
            return cached[1]
        attn, linears, norms = self.attn, state[:4], state[-2:]
        weights = None
        kernels = all(isinstance(m, BlockLinear | Fp4Linear) for m in linears) and all(
            m.bias is None for m in linears[1:]
        )
        bounds = [m.bound() for m in linears] if kernels and cpu_block.available() else [None]
        if all(b is not None for b in bounds) and self.attn_norm.eps == self.mlp_norm.eps:
            weights = cpu_block.BlockWeights(
                *bounds, *norms, self.mlp_norm.eps, attn.q_size, attn.kv_size, linears[0].bias
            )
        self.__dict__["_block_weights"] = (key, weights, state)  # state: keeps the tensors whose ids make the key
        return weights

    def weight_state(self) -> tuple:
        """What the bound weights are made of: the four linears, their classes (BlockLinear or Int8BlockLinear:
        which kernels read the blocks), their codes (an Fp4Linear's are replaced when its rows change kind:
        Fp4Linear.set_activations) and biases, then the two norms' weights."""
        modules = self._modules
        attn, mlp = modules["attn"]._modules, modules["mlp"]._modules
        q, o, g, d = attn["wqkv"], attn["wo"], mlp["w_gate_up"], mlp["w_down"]  # (spelt out: it runs every step)
        return (
            q, o, g, d, type(q), type(o), type(g), type(d),
            q._buffers.get("codes"), o._buffers.get("codes"), g._buffers.get("codes"), d._buffers.get("codes"),
            q._parameters.get("bias"), o._parameters.get("bias"), g._parameters.get("bias"), d._parameters.get("bias"),
            modules["attn_norm"]._parameters["weight"], modules["mlp_norm"]._parameters["weight"],
        )  # fmt: skip

    def forward_ops(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        """The block one kernel call at a time (any linear modules, any KV attention)."""
        norm = self.mlp_norm
        delta = self.attn(self.attn_norm(x), cos, sin, kv).contiguous()
        x, h = cpu_ops.add_rms_norm(x.contiguous(), delta, norm.weight, norm.eps)
        return x + self.mlp(h)


class CpuTransformer(Transformer):
    """Transformer whose blocks run in one C call (kernels/cpu_block.py `decode_layers`) where each would run as one
    (`CpuBlock.one_call`): the Python between blocks is left out (default model, int8 rows, 2 threads: a decode step
    4.07 -> 3.36 ms; docs/benchmarks.md, "Fifteenth session"). Otherwise the blocks one by one.

    The blocks' weights and pages are bound once (cpu_block.BoundLayers) and kept while `layer_state` finds the same
    objects in place: asking each block for them every step (`one_call`, ~8 us a block) took ~0.25 ms of a ~3.4 ms
    decode step."""

    def run_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention, taps: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        rows = x.numel() // x.shape[-1]
        bound = self.bound_layers(rows, kv) if cpu_ops.supported(x) and isinstance(kv, KVBatch) else None
        if bound is None:
            return super().run_blocks(x, cos, sin, kv, taps)
        attn = self._modules["layers"][0]._modules["attn"]
        plan = kv.cpu_plan(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        return cpu_block.decode_layers(bound, plan, x.contiguous(), cos, sin, taps, torch.get_num_threads())

    def bound_layers(self, rows: int, kv: KVBatch) -> cpu_block.BoundLayers | None:
        """The blocks bound for decode_layers where every block would run as one C call over `rows` rows, else None
        (a long prompt's rows, where the float GEMM is faster; a block that does not read GGUF blocks; pages the C
        kernel does not read)."""
        state = self.layer_state(kv)
        cached = self.__dict__.get("_bound_layers")
        if cached is None or len(cached[0]) != len(state) or not all(map(operator.is_, cached[0], state)):
            cached = self.__dict__["_bound_layers"] = (state, *self._bind_layers(kv))
        _, bound, gemms = cached
        if bound is None or any(linear.takes_gemm(rows) for linear in gemms):
            return None
        return bound

    def layer_state(self, kv: KVBatch) -> list:
        """Every object the bound layers depend on, in order: the page store (by weak reference: a KV format change
        empties the old store while the new one fills, and holding its pages would keep both in memory) and which
        kernel reads it, and per block its modules, the tensors CpuBlock.block_weights reads and the linears'
        classes (CpuBlock.weight_state: a rebound linear, a replaced buffer, set_activations or a new store all
        change it)."""
        state = [weakref.ref(kv.store), kv._cpu_kernel, kv._cpu_quantized]
        for block in self._modules["layers"]:
            state += (block, *block.weight_state()) if isinstance(block, CpuBlock) else (block,)
        return state

    def _bind_layers(self, kv: KVBatch) -> tuple[cpu_block.BoundLayers | None, list]:
        """(the blocks bound, the linears whose row count may send them to the float GEMM), or (None, []) where a
        block cannot run as one call."""
        layers = self._modules["layers"]
        calls = [block.one_call(1, kv) if isinstance(block, CpuBlock) else None for block in layers]
        if not calls or any(call is None for call in calls):
            return None, []
        plan = calls[0][1][0]
        bound = cpu_block.BoundLayers([w for w, _ in calls], [pages[1:] for _, pages in calls], plan)
        gemms = [block.mlp.w_gate_up for block in layers if block.mlp.w_gate_up.gemm_for_many_rows]
        return bound, gemms


FUSED = {
    Transformer: CpuTransformer,
    Block: CpuBlock,
    RMSNorm: CpuRMSNorm,
    Rotary: CpuRotary,
    SiluAndMul: CpuSiluAndMul,
}
# a bfloat16 model's linears (only these: its norms and the rest stay torch's); nn.Linear: what a switch back from
# MXFP4 weights puts in their place
BF16 = {Linear: Bf16Linear, nn.Linear: Bf16Linear}
PLAIN = {**{fused: plain for plain, fused in FUSED.items()}, Bf16Linear: Linear}


def unbind(model: nn.Module) -> None:
    """Drop the kernels' bindings of the model's weights (CpuTransformer's bound layers, each CpuBlock's bound
    weights), which hold what they bound. After a switch of weights the old ones are then freed at once, not at the
    next step, which binds the new ones anyway: the default model's process held 678-730 MB after a switch, 510-611 MB
    with the bindings dropped and the heap trimmed (docs/benchmarks.md, forty-second session)."""
    for module in model.modules():
        module.__dict__.pop("_bound_layers", None)
        module.__dict__.pop("_block_weights", None)


def fuse(model: nn.Module) -> int:
    """Use the CPU kernels in a float32 CPU model, or a bfloat16 one's linears (`Bf16Linear`); none where they do
    not load. Returns the modules swapped."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return 0
    if param.dtype == torch.bfloat16:
        return swap_classes(model, BF16) if cpu_gemv.available() else 0
    if param.dtype != torch.float32 or not cpu_ops.available():
        return 0
    return swap_classes(model, FUSED)


def unfuse(model: nn.Module) -> int:
    """Back to the plain PyTorch modules."""
    return swap_classes(model, PLAIN)
