"""The fused elementwise kernels as a transform of the model (docs/style.md #3): swap modules in, swap them out.

`fuse(model)` re-classes the model's `Transformer`, `Attention`, `RMSNorm`, `Rotary` and `SiluAndMul` modules
(engine/model.py) as the subclasses below, whose forward runs the Triton kernels of kernels/fused_triton.py where
kernels/fused.py says they run (CUDA, or the CPU under TRITON_INTERPRET=1; the kernels' module is imported at the
first launch, so a CPU process never imports Triton) and the plain module's forward otherwise; `unfuse(model)`
swaps them back. The parameters and state stay the same objects, so a model can be fused after loading and
unfused for checking. Besides one kernel per elementwise job, two fusions cut kernels per layer:

- `FusedTransformer` adds each residual in the same kernel as the norm that follows it (the attention's output
  with the MLP's norm, the MLP's output with the next layer's norm or the final one): two kernels less a layer.
- `FusedAttention` stores the step's keys and values in dense KV pages from the rotary kernel (the pool's write,
  two index_put kernels a layer, otherwise).
- `FusedLinear` runs steps of at most 16 rows of dense (bf16/fp16) weights through the Triton GEMV of
  kernels/dense_gemv_triton.py instead of cuBLAS, so a decode step's kernels are all ours and chain under PDL
  (kernels/pdl.py), and `FusedMLP` runs gate_up through its gated form: silu(gate) * up in the GEMV, one kernel
  less a layer. More rows (prefill, many sessions), and MXFP4 weights (`Fp4Linear`), keep their own paths. The
  default model's shape decodes 1.24x faster at batch 1 on the H200 with it (SPECCHAT_DENSE_GEMV=0 turns it off).

At batch 1 on a GPU a step is a chain of small launches (a 30-layer model: ~13 kernels a layer), so each kernel
less is time saved even inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specchat.engine.model import MLP, Attention, KVAttention, Linear, RMSNorm, Rotary, SiluAndMul, Transformer
from specchat.kernels import dense_gemv, fused


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused.rms_norm_supported(x, self.weight):
            return super().forward(x)
        from specchat.kernels import fused_triton

        return fused_triton.rms_norm(x, self.weight, self.eps)


class FusedRotary(Rotary):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not fused.rope_qk_supported(q):
            return super().forward(q, k, cos, sin)
        from specchat.kernels import fused_triton

        return fused_triton.rope_qk(q, k, cos, sin)


class FusedSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused.silu_mul_supported(x):
            return super().forward(x)
        from specchat.kernels import fused_triton

        return fused_triton.silu_mul(x)


class FusedLinear(Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not dense_gemv.wanted(x, self.weight, self.bias):
            return super().forward(x)
        from specchat.kernels import dense_gemv_triton

        return dense_gemv_triton.dense_gemv(x, self.weight, self.bias)


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up
        if type(gate_up) is not FusedLinear or not dense_gemv.wanted(x, gate_up.weight, gate_up.bias):
            return super().forward(x)  # (an MXFP4 Fp4Linear, or too many rows)
        from specchat.kernels import dense_gemv_triton

        return self.w_down(dense_gemv_triton.dense_gemv(x, gate_up.weight, gate_up.bias, gated=True))


class FusedAttention(Attention):
    """Attention whose rotary kernel also writes the step's keys and values where the KV batch keeps dense pages
    (`KVBatch.dense_pages`); elsewhere (quantized or rotated pages, other KV views) the plain forward."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        dense_pages = getattr(kv, "dense_pages", None)
        pages = dense_pages(self.layer) if dense_pages is not None else None
        q, k, v = self.project(x)
        if pages is None or not fused.rope_qk_supported(q):
            q, k = self.rotary(q, k, cos, sin)
            out = kv.attend(self.layer, q, k, v)
        else:
            from specchat.kernels import fused_triton

            q, k = fused_triton.rope_qk(q, k, cos, sin, v=v, pages=pages)
            out = kv.attend(self.layer, q, k, v, written=True)
        return self.wo(out.reshape(x.shape[0], self.q_size))


class FusedTransformer(Transformer):
    """The layer loop with each residual add fused into the norm after it (`fused_triton.add_rms_norm`); the same
    arithmetic as Block.forward's adds followed by the norms, so the same bits."""

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVAttention,
        taps: Sequence[int] = (),
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        x = self.embed(ids)
        if not fused.rms_norm_supported(x, self.norm.weight):
            return super().forward(ids, positions, kv, taps, logits_at)
        from specchat.kernels import fused_triton

        cos, sin = self.rope(positions)
        hidden: dict[int, torch.Tensor] = {}
        layers = self.layers
        normed = layers[0].attn_norm(x) if len(layers) else self.norm(x)
        for i, block in enumerate(layers):
            x, normed = fused_triton.add_rms_norm(
                x, block.attn(normed, cos, sin, kv), block.mlp_norm.weight, block.mlp_norm.eps
            )
            after = layers[i + 1].attn_norm if i + 1 < len(layers) else self.norm
            x, normed = fused_triton.add_rms_norm(x, block.mlp(normed), after.weight, after.eps)
            if i in taps:
                hidden[i] = x
        if logits_at is not None:
            normed = normed[logits_at]
        return self.lm_head(normed).float(), hidden


FUSED = {
    Transformer: FusedTransformer,
    Attention: FusedAttention,
    RMSNorm: FusedRMSNorm,
    Rotary: FusedRotary,
    SiluAndMul: FusedSiluAndMul,
    Linear: FusedLinear,
    MLP: FusedMLP,
}
PLAIN = {fused_cls: plain for plain, fused_cls in FUSED.items()}


def swap_classes(model: nn.Module, mapping: dict[type, type]) -> int:
    """Re-class matching modules in place (same parameters, same state): returns how many were swapped (the CUDA
    and the CPU fusions both)."""
    swapped = 0
    for module in model.modules():
        new = mapping.get(type(module))
        if new is not None:
            module.__class__ = new
            swapped += 1
    return swapped


def fuse(model: nn.Module) -> int:
    """Use the fused kernels in `model` (where its tensors are on CUDA); returns the number of modules swapped."""
    return swap_classes(model, FUSED)


def fuse_linears(model: nn.Module) -> int:
    """Re-class the model's plain `nn.Linear` modules as `FusedLinear` (a weights switch back to the dense form puts
    plain ones in; quant/ imports no engine module to make ours); returns how many."""
    return swap_classes(model, {nn.Linear: FusedLinear})


def unfuse(model: nn.Module) -> int:
    """Back to the plain PyTorch modules."""
    return swap_classes(model, PLAIN)
