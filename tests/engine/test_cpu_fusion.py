"""The CPU kernels as a model transform (engine/cpu_fusion.py) and the C paged attention of the KV batch, against the
plain modules and `--eager`: same logits within float32 rounding, same greedy tokens, speculation still exact.

The kernels themselves are held to their references in tests/kernels/test_cpu_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine import cpu_fusion
from specchat.engine.model import Block, RMSNorm, Rotary, SiluAndMul, Transformer
from specchat.kernels import cpu_ops
from tests.engine.test_fusion import CFG, logits

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler for the CPU kernels")

PROMPTS = ["hello there", "the quick brown fox jumps over the lazy dog", "a b a b a b a b"]


def test_fuse_swaps_blocks_norms_rotary_and_activation_and_unfuse_swaps_them_back():
    model = Transformer(CFG)
    parameters = list(model.parameters())
    assert cpu_fusion.fuse(model) == 2 * 5 + 1  # block, two norms, rotary, act per layer + the final norm
    assert isinstance(model.layers[0], cpu_fusion.CpuBlock) and isinstance(model.norm, cpu_fusion.CpuRMSNorm)
    assert cpu_fusion.fuse(model) == 0  # already fused
    assert cpu_fusion.unfuse(model) == 11
    assert type(model.layers[0]) is Block and type(model.norm) is RMSNorm
    assert type(model.layers[1].attn.rotary) is Rotary and type(model.layers[1].mlp.act) is SiluAndMul
    assert all(a is b for a, b in zip(model.parameters(), parameters, strict=True))  # the same tensors


def test_fuse_leaves_a_bfloat16_model_alone():
    assert cpu_fusion.fuse(Transformer(CFG).to(torch.bfloat16)) == 0


def test_fused_model_keeps_the_logits_and_unfuse_restores_them():
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    ids = torch.randint(0, CFG.vocab_size, (11,))
    want = logits(model, ids)
    cpu_fusion.fuse(model)
    torch.testing.assert_close(logits(model, ids), want, rtol=1e-5, atol=1e-5)
    cpu_fusion.unfuse(model)
    assert torch.equal(logits(model, ids), want)


@pytest.fixture(scope="module")
def tiny_eager(tiny_model_dir):
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", eager=True))


def greedy(engine, prompt: str, drafter: str = "none", tokens: int = 32) -> list[int]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return engine.submit(engine.encode_prompt(prompt), params, SpecParams(drafter=drafter)).result().token_ids


def test_default_cpu_engine_is_fused_and_eager_is_not(tiny_engine, tiny_eager):
    assert tiny_engine.pool.cpu_kernels and not tiny_eager.pool.cpu_kernels
    assert all(isinstance(b, cpu_fusion.CpuBlock) for b in tiny_engine.model.layers)
    assert not any(isinstance(m, cpu_fusion.CpuBlock) for m in tiny_eager.model.modules())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_eager(tiny_engine, tiny_eager, prompt, monkeypatch):
    calls = []
    kernel = cpu_ops.paged_attention
    monkeypatch.setattr(cpu_ops, "paged_attention", lambda *a: calls.append(1) or kernel(*a))
    assert greedy(tiny_engine, prompt) == greedy(tiny_eager, prompt)
    assert len(calls) >= 31 * tiny_engine.model.cfg.num_layers  # every decode step attended in C


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_exact_on_fused_path(tiny_engine, prompt):
    assert greedy(tiny_engine, prompt, "ngram") == greedy(tiny_engine, prompt)


@pytest.mark.slow
def test_default_model_fused_equals_eager_over_a_long_answer(default_engine):
    """The default model on the defaults path (GGUF blocks + these kernels) against --eager for 128 tokens;
    tests/engine/test_cpu_weights.py holds three shorter answers and ngram speculation on the same engine."""
    from specchat.engine.engine import Engine

    assert all(isinstance(b, cpu_fusion.CpuBlock) for b in default_engine.model.layers)
    eager = Engine.load(EngineConfig(device="cpu", dtype="float32", eager=True))
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    assert greedy(default_engine, prompt, tokens=128) == greedy(eager, prompt, tokens=128)
