"""Tensor parallelism end to end on the CPU: rank 0 here, one worker process, gloo (engine.tp).

A TP=2 engine and a TP=1 engine over the same tiny fp32 model must give the same greedy tokens (plain decoding and
verification of n-gram drafts, a batch of requests, a prefix-cache hit, a KV format switch) and the same logits;
the sharded model with MXFP4 weights must equal the unsharded model with the same MXFP4 weights; what --tp cannot
do ends in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specchat.cli import main
from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.engine import Engine
from specchat.engine.runner import StepBatch
from specchat.errors import ConfigError
from specchat.quant.handler import FALLBACK_LAYERS, FALLBACK_RULE
from specchat.quant.modules import fp4_modules, round_to_nearest, select_linears, swap_modules
from tests.conftest import save_tiny_hf

PROMPTS = ["the quick brown fox", "hello world hello world hello world", "a b c d e f g a b c d e f g a b c"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TP_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def answers(engine: Engine, spec: SpecParams, prompts=PROMPTS) -> list[list[int]]:
    """Every prompt submitted at once (one batch), greedy; their tokens."""
    handles = [engine.submit(p, GREEDY, spec, raw=True) for p in prompts]
    results = [h.result() for h in handles]
    assert all(r.reason == "length" for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


def logits_of(engine: Engine, ids: list[int]) -> torch.Tensor:
    """One prefill forward's logits over every row, through the engine's runner (rank 0 and the worker)."""
    seq_id = 10**6
    engine.pool.add(seq_id, [])
    try:
        return engine.runner.forward(StepBatch([seq_id], [ids], [0], [len(ids)])).flat_logits.clone()
    finally:
        engine.pool.free(seq_id)


@pytest.fixture(scope="module")
def gqa_pair(tiny_model_dir: Path):
    """The tiny Llama (4 heads, 2 KV heads: one KV head per rank) at TP=1 and TP=2."""
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", kv_format="fp32")
    one = Engine.load(config)  # (float32 pages: what the eager TP workers' "auto" is; the C kernels' is float16)
    two = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", tp=2))
    yield one, two
    two.close()


def test_tp2_greedy_tokens_and_logits_equal_tp1(gqa_pair):
    one, two = gqa_pair
    ids = one.tokenizer.encode(PROMPTS[0])
    torch.testing.assert_close(logits_of(two, ids), logits_of(one, ids), rtol=1e-4, atol=1e-4)
    for spec in (SpecParams(drafter="none"), SpecParams(drafter="ngram", k=3)):
        assert answers(two, spec) == answers(one, spec)
    # The same prompts again: their prompt pages now come from the prefix cache on rank 0, KV from every rank.
    assert answers(two, SpecParams(drafter="ngram", k=3)) == answers(one, SpecParams(drafter="ngram", k=3))
    assert two.pool.num_kv_heads == one.pool.num_kv_heads // 2


def test_tp2_kv_format_switch_reaches_the_worker(gqa_pair):
    one, two = gqa_pair
    for engine in (one, two):
        engine.set_kv("bf16")
    try:
        assert answers(two, SpecParams(drafter="ngram", k=2)) == answers(one, SpecParams(drafter="ngram", k=2))
    finally:
        for engine in (one, two):
            engine.set_kv("fp32")


def test_tp_refuses_what_it_cannot_do_in_one_line(gqa_pair, monkeypatch):
    _, two = gqa_pair
    with pytest.raises(ConfigError, match="the heads drafter reads the target's whole output head"):
        two.drafter("heads")
    with pytest.raises(ConfigError, match="cannot switch to mxfp4 while --tp splits the model"):
        two.set_weights("mxfp4")
    assert two.memory()["weights_format"] == "bf16"
    assert all(os.environ[name] in ("0", "1") for name in TP_ENV)

    import specchat.engine.tp.launch as launch

    monkeypatch.setattr(launch, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^--tp 2 needs 2 GPUs; this machine has 1$"):
        Engine.load(EngineConfig(model=two.model_spec.where, device="cuda", tp=2))


def test_tp2_with_one_kv_head_and_qkv_bias_mxfp4_equals_the_unsharded_mxfp4_model(tmp_path_factory):
    """Qwen2 (q/k/v biases) with a single KV head, replicated on both ranks; MXFP4 weights (round to nearest over
    the block linears, each rank rounding its own slices) against the same MXFP4 weights unsharded."""
    path = save_tiny_hf(tmp_path_factory.mktemp("tiny-qwen"), {"model_type": "qwen2", "num_key_value_heads": 1})
    one = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_format="fp32"))
    swap_modules(one.model, fp4_modules(one.model, round_to_nearest(one.model, select_linears(one.model, FALLBACK_LAYERS), FALLBACK_RULE)))  # fmt: skip
    two = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", weights="mxfp4", tp=2))
    try:
        assert two.memory()["weights_format"] == "mxfp4"
        ids = one.tokenizer.encode(PROMPTS[1])
        torch.testing.assert_close(logits_of(two, ids), logits_of(one, ids), rtol=1e-4, atol=1e-4)
        assert answers(two, SpecParams(drafter="none")) == answers(one, SpecParams(drafter="none"))
    finally:
        two.close()


def test_generate_tp2_on_the_cpu_end_to_end(tiny_model_dir: Path):
    args = ["generate", str(tiny_model_dir), "--device", "cpu", "--raw", "-p", PROMPTS[0], "--max-tokens", "12"]
    plain = CliRunner().invoke(main, [*args, "--drafter", "none"])
    split = CliRunner().invoke(main, [*args, "--drafter", "ngram", "--tp", "2"])
    assert plain.exit_code == 0, plain.output
    assert split.exit_code == 0, split.output
    assert split.stdout == plain.stdout and plain.stdout.strip()

    odd = CliRunner().invoke(main, [*args, "--tp", "3"])
    assert odd.exit_code == 1
    assert odd.output.strip().splitlines()[-1].endswith("the model's 4 attention heads do not divide into 3 ranks")
