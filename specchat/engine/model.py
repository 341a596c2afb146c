"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama) in plain eager PyTorch.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, "rotate half" layout as in HF
transformers), grouped-query attention (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020).

The forward pass works on a ragged batch: the new tokens of every request are concatenated into one flat
sequence of T tokens, each with its own position. Attention reads and writes the KV cache only through the
`kv` object (a `KVBatch` from engine.kv_batch), which knows which request each token belongs to and where its
keys and values live. Speed is applied from outside (torch.compile, CUDA graphs, quantized Linear modules);
this file stays the readable reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model."""

    arch: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear" | "freq_factors", ...}
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class KVAttention(Protocol):
    """What a layer needs from the KV cache: store this step's keys/values, attend over the whole context."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (after RoPE) -> attention output [T, H, D], causal per request."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the reference implementations do, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama 3.1's frequency-dependent scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "freq_factors":  # GGUF files of Llama 3.1 store the per-frequency divisors precomputed
        return (inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, interpolate in between.
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


class Linear(nn.Linear):
    """nn.Linear whose random init is skipped on the meta device: a skeleton that a checkpoint fills. There, torch
    runs the init through its python reference ops, whose first call imports torch._dynamo: 2 s of every start."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Embedding(nn.Embedding):
    """nn.Embedding whose random init is skipped on the meta device (as Linear's)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RotaryEmbedding(nn.Module):
    """cos/sin of position x frequency, computed for the positions at hand (no table, no host sync: the
    same in eager mode and inside a CUDA graph)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # computed on the CPU and moved: under torch.device("meta") the math would run through torch's python
        # reference ops, whose first call imports torch._dynamo (seconds of every start)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], fp32 as in HF transformers
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]. Computed in fp32."""
    xf = x.float()
    out = xf * cos[:, None, :] + rotate_half(xf) * sin[:, None, :]
    return out.to(x.dtype)


class Rotary(nn.Module):
    """RoPE applied to a step's queries and keys (a module, so a fused kernel can take its place)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class SiluAndMul(nn.Module):
    """SwiGLU's gate: [gate | up] -> silu(gate) * up."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        # q, k and v projections fused into one matrix: one weight read per step instead of three.
        self.wqkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = Rotary()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = self.rotary(q, k, cos, sin)
        out = kv.attend(self.layer, q, k, v)  # [T, H, D]
        return self.wo(out.reshape(x.shape[0], self.q_size))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D] (views of one fused projection)."""
        t = x.shape[0]
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
        )


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matrix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.act(self.w_gate_up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVAttention,
        taps: Sequence[int] = (),
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ids, positions [T] -> (logits [len(logits_at) or T, vocab] in fp32, {layer: hidden [T, hidden]}).

        `taps` names blocks whose output (the residual stream after that block) is returned; `logits_at`
        picks the token rows that need logits (prefill needs only each request's last one).
        """
        x = self.embed(ids)  # [T, hidden]
        cos, sin = self.rope(positions)
        x, hidden = self.run_blocks(x, cos, sin, kv, taps)
        if logits_at is not None:
            x = x[logits_at]
        return self.lm_head(self.norm(x)).float(), hidden

    def run_blocks(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention, taps: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The blocks in turn: (the last one's output, {block i in taps: its output})."""
        hidden: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, kv)
            if i in taps:
                hidden[i] = x
        return x, hidden


def skeleton(cfg: ModelConfig) -> Transformer:
    """The Transformer's modules over meta tensors: shapes only, no memory and no random init, what a checkpoint's
    tensors are checked against and then assigned to (`load_state_dict(assign=True)`)."""
    with torch.device("meta"):
        return Transformer(cfg)
