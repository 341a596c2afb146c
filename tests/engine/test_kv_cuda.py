"""On CUDA the model attends through the Triton paged kernel and quantizes with the Triton writer; on CPU through
the torch reference. The same steps (prefill, decode, a verification step, a rollback, a format switch) must give
the same logits on both."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.kv_cache import KVPool
from specchat.engine.loader import build_model, load_checkpoint
from specchat.engine.runner import ModelRunner, StepBatch
from tests.conftest import save_tiny_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_steps(path, device: str, kv_format: str) -> list[torch.Tensor]:
    cfg, state = load_checkpoint(path)
    model = build_model(cfg, state, torch.float32, device)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, 16, torch.float32, device, kv_format)
    runner = ModelRunner(model, pool)
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    logits, pos = [], 0
    pool.add(0, ids)

    def step(feed: list[int], rows: int) -> None:
        nonlocal pos
        logits.append(runner.forward(StepBatch([0], [feed], [pos], [rows])).logits[0].cpu())
        pos += len(feed)

    step(ids[:37], 1)  # prefill
    for t in ids[37:40]:  # decode
        step([t], 1)
    step(ids[40:45], 5)  # verification of 4 drafts
    pool.truncate(0, 42)  # two accepted
    pos = 42
    step(ids[42:43], 1)
    pool.convert("k8v4" if kv_format == "mxfp4" else "mxfp4")  # live switch
    step(ids[43:46], 3)
    return logits


@pytest.mark.parametrize("kv_format", ["fp32", "mxfp4"])
def test_cuda_kernel_path_matches_cpu_reference(tmp_path, kv_format):
    path = save_tiny_hf(tmp_path, {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}, seed=7)
    cpu, cuda = run_steps(path, "cpu", kv_format), run_steps(path, "cuda", kv_format)
    for a, b in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)


def mixed_step_logits(path, device: str) -> list[torch.Tensor]:
    """Two requests decode / verify while a third is admitted: the admitting step mixes a fresh prompt with
    cached requests (on CUDA the prompt attends to its own keys, the others through the paged kernel)."""
    cfg, state = load_checkpoint(path)
    model = build_model(cfg, state, torch.float32, device)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, 16, torch.float32, device)
    runner = ModelRunner(model, pool)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b, c = ids[:30], ids[30:55], ids[55:]
    for seq, prompt in enumerate((a, b)):
        pool.add(seq, prompt)
        runner.forward(StepBatch([seq], [prompt], [0], [1]))
    pool.add(2, c)
    mixed = StepBatch([0, 2, 1], [a[:1], c, b[:5]], [30, 0, 25], [1, 1, 5])
    return [out.cpu() for out in runner.forward(mixed).logits]


def test_a_step_admitting_a_prompt_beside_running_requests_matches_the_reference(tmp_path):
    path = save_tiny_hf(tmp_path, {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}, seed=3)
    for got, want in zip(mixed_step_logits(path, "cuda"), mixed_step_logits(path, "cpu"), strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
