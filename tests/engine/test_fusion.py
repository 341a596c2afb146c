"""fuse / unfuse: the fused kernels swapped into a model keep its output, and swapping back restores it exactly.

The kernels themselves are held to their references in tests/kernels/test_fused.py. Kernel tests run on CUDA,
or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file in a subprocess with it set).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specchat.engine.fusion import FusedRMSNorm, FusedRotary, FusedSiluAndMul, fuse, unfuse
from specchat.engine.model import ModelConfig, RMSNorm, Rotary, SiluAndMul, Transformer
from tests.kernels.interpreter import DEVICE, INTERPRET, kernel_test, run_under_interpreter, subprocess_test

CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=256)  # fmt: skip


class DenseCausalKV:
    """model.KVAttention for one sequence run all at once: plain causal attention, no cache."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        heads_first = [t.transpose(0, 1) for t in (q, k, v)]  # [heads, T, D]
        return F.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True).transpose(0, 1)


def logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, torch.arange(len(ids), device=ids.device), DenseCausalKV())[0]


def test_fuse_swaps_every_norm_rotary_and_activation_and_unfuse_swaps_them_back():
    model = Transformer(CFG)
    parameters = list(model.parameters())
    assert fuse(model) == 2 * 2 + 1 + 2 * 2  # two norms, rotary, act per layer + the final norm
    assert isinstance(model.norm, FusedRMSNorm) and isinstance(model.layers[1].mlp.act, FusedSiluAndMul)
    assert isinstance(model.layers[0].attn.rotary, FusedRotary)
    assert fuse(model) == 0  # already fused
    assert unfuse(model) == 9
    assert type(model.norm) is RMSNorm and type(model.layers[0].attn.rotary) is Rotary
    assert type(model.layers[1].mlp.act) is SiluAndMul
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # the same tensors


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs the kernels on the CPU")
def test_fused_modules_run_the_plain_forward_where_the_kernels_do_not_run():
    """On the CPU without the interpreter the fused model gives the plain model's logits bit for bit."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    ids = torch.randint(0, 64, (9,))
    want = logits(model, ids)
    fuse(model)
    assert torch.equal(logits(model, ids), want)


@kernel_test
def test_fuse_keeps_the_model_output_and_unfuse_restores_it():
    torch.manual_seed(0)
    model = Transformer(CFG).to(DEVICE).eval()
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = logits(model, ids)
    assert fuse(model) == 9
    torch.testing.assert_close(logits(model, ids), want, atol=1e-5, rtol=1e-5)
    assert unfuse(model) == 9
    assert torch.equal(logits(model, ids), want)


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "not under_interpreter")
