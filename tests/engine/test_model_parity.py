"""Our model equals HF transformers on tiny random Llama-family checkpoints (fp32, tight tolerance)."""

from __future__ import annotations

import pytest
import torch

from specchat.engine.kv_cache import KVPool
from specchat.engine.loader import build_model, load_checkpoint
from specchat.engine.runner import ModelRunner, StepBatch
from tests.conftest import save_tiny_hf

CASES = {
    "llama": {},
    "llama-tied": {"tie_word_embeddings": True},
    "llama3-rope-scaling": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "rope_theta": 500000.0,
    },
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "mha-headdim": {"num_key_value_heads": 4, "head_dim": 32},
}


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def ours(path):
    cfg, sd = load_checkpoint(path)
    model = build_model(cfg, sd, torch.float32, "cpu")
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16, torch.float32, "cpu")
    return model, ModelRunner(model, pool)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_match_hf(tmp_path, case):
    path = save_tiny_hf(tmp_path, CASES[case], seed=1)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(2))
    expected = hf_logits(path, ids)
    _, runner = ours(path)
    runner.pool.add(0, ids.tolist())
    out = runner.forward(StepBatch([0], [ids.tolist()], [0], [len(ids)]))
    torch.testing.assert_close(out.logits[0], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_incremental_decode_matches_full_forward(tmp_path, case):
    """Prefill a prefix, then feed the rest in ragged chunks through the paged cache: same logits as HF."""
    path = save_tiny_hf(tmp_path, CASES[case], seed=3)
    ids = torch.randint(0, 49152, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    expected = hf_logits(path, torch.tensor(ids))
    _, runner = ours(path)
    runner.pool.add(0, ids)
    got, pos = [], 0
    for chunk in (17, 1, 1, 5, 1, 12):  # crosses page boundaries (page size 16)
        feed = ids[pos : pos + chunk]
        got.append(runner.forward(StepBatch([0], [feed], [pos], [len(feed)])).logits[0])
        pos += chunk
    torch.testing.assert_close(torch.cat(got), expected, atol=2e-5, rtol=1e-4)


def test_ragged_batch_equals_separate_runs(tmp_path):
    """Two requests in one forward give the same logits as each alone."""
    path = save_tiny_hf(tmp_path, seed=5)
    gen = torch.Generator().manual_seed(6)
    a = torch.randint(0, 49152, (9,), generator=gen).tolist()
    b = torch.randint(0, 49152, (21,), generator=gen).tolist()
    _, runner = ours(path)
    runner.pool.add(0, a)
    runner.pool.add(1, b)
    both = runner.forward(StepBatch([0, 1], [a[:5], b[:20]], [0, 0], [5, 20]))
    both2 = runner.forward(StepBatch([0, 1], [a[5:], b[20:]], [5, 20], [4, 1]))
    ref_a, ref_b = hf_logits(path, torch.tensor(a)), hf_logits(path, torch.tensor(b))
    torch.testing.assert_close(torch.cat([both.logits[0], both2.logits[0]]), ref_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([both.logits[1], both2.logits[1]]), ref_b, atol=2e-5, rtol=1e-4)


def test_hidden_state_taps(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_hf(tmp_path, seed=7)
    ids = list(range(100, 112))
    _, runner = ours(path)
    runner.pool.add(0, ids)
    out = runner.forward(StepBatch([0], [ids], [0], [1]), taps=[0])
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden[0][0], states[1][0], atol=1e-5, rtol=1e-4)
