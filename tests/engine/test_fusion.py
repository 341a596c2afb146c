"""fuse / unfuse: the fused kernels swapped into a model keep its output, and swapping back restores it exactly.

The kernels themselves are held to their references in tests/kernels/test_fused.py. Kernel tests run on CUDA,
or on CPU under TRITON_INTERPRET=1 (`test_kernels_under_interpreter` reruns this file in a subprocess with it set).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specchat.engine.fusion import (
    FusedAttention,
    FusedLinear,
    FusedMLP,
    FusedRMSNorm,
    FusedRotary,
    FusedSiluAndMul,
    FusedTransformer,
    fuse,
    unfuse,
)
from specchat.engine.kv_cache import KVPool
from specchat.engine.kv_pages import PageStore
from specchat.engine.model import Attention, ModelConfig, RMSNorm, Rotary, SiluAndMul, Transformer
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


SWAPPED = 1 + 2 * 10 + 2  # the model; per layer two norms, attention, rotary, act, four linears, the MLP; the
# final norm and the output head


def test_fuse_swaps_every_norm_rotary_and_activation_and_unfuse_swaps_them_back():
    model = Transformer(CFG)
    parameters = list(model.parameters())
    assert fuse(model) == SWAPPED
    assert isinstance(model.norm, FusedRMSNorm) and isinstance(model.layers[1].mlp.act, FusedSiluAndMul)
    assert isinstance(model.layers[0].attn.rotary, FusedRotary) and isinstance(model.layers[0].attn, FusedAttention)
    assert isinstance(model, FusedTransformer) and isinstance(model.layers[0].mlp, FusedMLP)
    assert isinstance(model.layers[0].attn.wqkv, FusedLinear) and isinstance(model.lm_head, FusedLinear)
    assert fuse(model) == 0  # already fused
    assert unfuse(model) == SWAPPED
    assert type(model.norm) is RMSNorm and type(model.layers[0].attn.rotary) is Rotary
    assert type(model.layers[1].mlp.act) is SiluAndMul and type(model.layers[0].attn) is Attention
    assert type(model) is Transformer
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # the same tensors


def test_linears_a_weights_switch_puts_back_plain_are_fused_again():
    """A switch from MXFP4 back to the dense form swaps in plain nn.Linear modules (quant.modules); Engine.set_weights
    re-classes them, or a GPU step would lose the dense GEMV and its PDL chain."""
    from torch import nn

    from specchat.engine.fusion import fuse_linears
    from specchat.quant.modules import swap_modules

    model = Transformer(CFG)
    fuse(model)
    plain = nn.Linear(CFG.intermediate_size, CFG.hidden_size, bias=False)
    swap_modules(model, {"layers.1.mlp.w_down": plain})
    assert type(model.layers[1].mlp.w_down) is nn.Linear
    assert fuse_linears(model) == 1
    assert model.layers[1].mlp.w_down is plain and isinstance(plain, FusedLinear)


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
    assert fuse(model) == SWAPPED
    torch.testing.assert_close(logits(model, ids), want, atol=1e-5, rtol=1e-5)
    assert unfuse(model) == SWAPPED
    assert torch.equal(logits(model, ids), want)


@kernel_test
def test_a_half_precision_model_decodes_through_the_dense_gemv(monkeypatch):
    """fp16 weights: steps of up to dense_gemv.MAX_ROWS rows run every linear through kernels/dense_gemv_triton.py (gate_up in its gated
    form, so the SiLU kernel is skipped) with logits within fp16 rounding of the plain model's; longer ones take
    F.linear as before."""
    from specchat.kernels import dense_gemv, dense_gemv_triton

    monkeypatch.setattr(dense_gemv, "ENABLED", True)
    torch.manual_seed(0)
    model = Transformer(CFG).to(DEVICE, torch.float16).eval()
    short, long = (
        torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE)
        for n in (9, dense_gemv.MAX_ROWS + 4)
    )
    want = [logits(model, ids) for ids in (short, long)]
    fuse(model)
    calls = []
    real = dense_gemv_triton.dense_gemv
    monkeypatch.setattr(
        dense_gemv_triton, "dense_gemv", lambda *a, **kw: calls.append(kw.get("gated", False)) or real(*a, **kw)
    )
    got = logits(model, short)
    assert calls.count(True) == CFG.num_layers and calls.count(False) == 3 * CFG.num_layers + 1
    torch.testing.assert_close(got, want[0], atol=2e-2, rtol=2e-2)
    calls.clear()
    torch.testing.assert_close(logits(model, long), want[1], atol=2e-2, rtol=2e-2)
    assert not calls  # more rows: cuBLAS (F.linear)


def paged_steps(model: Transformer, feeds: list[list[int]], kv_format: str, taps: tuple[int, ...] = (0,)):
    """One request fed step by step through a KV pool: each step's logits and tapped states, and the pool."""
    c = model.cfg
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 16, 4, torch.float32, DEVICE, kv_format=kv_format)
    pool.add(0, [t for feed in feeds for t in feed])
    out, start = [], 0
    with torch.inference_mode():
        for feed in feeds:
            kv = pool.prepare([0], [len(feed)], c.head_dim**-0.5)
            positions = torch.arange(start, start + len(feed), device=DEVICE)
            out.append(model(torch.tensor(feed, device=DEVICE), positions, kv, taps=taps))
            start += len(feed)
    return out, pool


@kernel_test
@pytest.mark.parametrize("kv_format", ["fp32", "mxfp4"])
def test_fused_layers_write_the_kv_pages_and_keep_logits_and_taps(kv_format, monkeypatch):
    """Through a paged KV pool (a prompt, then single tokens reading it back): dense pages get the step's keys and
    values from the rotary kernel, quantized ones through the pool's write as before; logits, tapped states and
    the pages equal the plain model's."""
    torch.manual_seed(0)
    # dense pages: a hidden size that is not a power of two (the rotary kernel takes head_dim, not hidden: 576 on
    # the default model); mxfp4 pages: 32-element blocks
    cfg = (
        replace(CFG, hidden_size=48) if kv_format == "fp32" else replace(CFG, num_heads=2, num_kv_heads=1, head_dim=32)
    )
    model = Transformer(cfg).to(DEVICE).eval()
    feeds = [[3, 9, 1, 7, 22, 5], [11], [2], [40]]
    want, want_pool = paged_steps(model, feeds, kv_format)
    fuse(model)
    pool_writes = []
    write = PageStore.write
    monkeypatch.setattr(PageStore, "write", lambda self, *a: pool_writes.append(1) or write(self, *a))
    got, got_pool = paged_steps(model, feeds, kv_format)
    assert len(pool_writes) == (0 if kv_format == "fp32" else len(feeds) * cfg.num_layers)
    for (got_logits, got_taps), (want_logits, want_taps) in zip(got, want, strict=True):
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_taps[0], want_taps[0], atol=1e-5, rtol=1e-5)
    for layer in range(cfg.num_layers):
        for got_pages, want_pages in ((got_pool.store.k, want_pool.store.k), (got_pool.store.v, want_pool.store.v)):
            used = slice(0, sum(map(len, feeds)))  # one request from page 0 on: slots 0..n-1
            got_rows, want_rows = got_pages[layer].data[:, used], want_pages[layer].data[:, used]
            torch.testing.assert_close(got_rows.float(), want_rows.float(), atol=1e-5, rtol=1e-5)


@subprocess_test
def test_kernels_under_interpreter():
    run_under_interpreter([__file__], "not under_interpreter")
