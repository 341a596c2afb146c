"""Int8 activations on the CPU block kernels (`--cpu-act int8`: engine/cpu_weights.set_activations): the whole-block
call against the per-op path, verification rows against decode rows, lossless speculation on the default model,
and the configurations that cannot have them."""

from __future__ import annotations

import pytest
import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine import cpu_fusion
from specchat.engine.cpu_weights import BlockLinear, Int8BlockLinear, set_activations
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Transformer
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.errors import ConfigError
from specchat.kernels import cpu_block, cpu_gemv, cpu_gemv_i8
from tests.engine.test_cpu_fusion import run_steps, with_gguf_blocks
from tests.engine.test_fusion import CFG

needs_vnni = pytest.mark.skipif(not cpu_gemv_i8.available(), reason="no C compiler or no AVX512-VNNI or AVX2")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"cpu_act": "int4"}, "cpu-act must be one of"),
        ({"cpu_act": "int8", "eager": True}, "--eager"),
        ({"cpu_act": "int8", "device": "cuda"}, "--device cuda"),
        ({"cpu_act": "int8", "tp": 2}, "--tp"),
    ],
)
def test_configs_without_the_block_kernels_are_refused(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        EngineConfig(**kwargs)


def test_auto_is_the_default_and_never_refused():
    """auto (the default) is int8 where the CPU block kernels run with VNNI, fp32 elsewhere: never an error."""
    assert EngineConfig().cpu_act == "auto"
    for kwargs in ({"eager": True}, {"device": "cuda"}, {"tp": 2}):
        EngineConfig(**kwargs)


def test_auto_keeps_float_rows_where_int8_cannot_run(tiny_model_dir):
    """A model without GGUF blocks, and --eager, load under auto as they did before it."""
    from specchat.engine.engine import Engine

    for eager in (False, True):
        engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", eager=eager))
        assert not any(isinstance(m, Int8BlockLinear) for m in engine.model.modules())


@needs_vnni
def test_a_model_without_gguf_blocks_is_refused(tiny_model_dir):
    from specchat.engine.engine import Engine

    with pytest.raises(ConfigError, match="quantized GGUF weights"):
        Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", cpu_act="int8"))


def gguf_model() -> Transformer:
    """The tiny model with GGUF blocks in every block linear and a Q8_0 lm_head (as the default model's), so that
    every linear of a step is batch-independent (torch's float GEMM is not)."""
    torch.manual_seed(0)
    model = with_gguf_blocks(Transformer(CFG).eval())
    head = model.lm_head
    g = torch.Generator().manual_seed(1)
    blocks = (torch.randint(-127, 128, head.weight.shape, dtype=torch.int8, generator=g),)
    blocks += ((torch.rand(head.weight.shape[0], head.weight.shape[1] // 32, generator=g) * 0.01).half().float(),)
    head.weight.data = cpu_gemv.q8_dequantize(*blocks)
    head.__class__, head.kind = BlockLinear, "q8_0"
    for name, value in zip(("codes", "d"), blocks, strict=True):
        head.register_buffer(name, value, persistent=False)
    return model


@needs_vnni
def test_set_activations_swaps_the_packed_linears_both_ways():
    model = gguf_model()
    assert set_activations(model, "int8") == 4 * CFG.num_layers + 1
    assert all(type(m) is Int8BlockLinear for m in model.modules() if isinstance(m, BlockLinear))
    assert isinstance(model.layers[0].attn.wo.bound(), cpu_gemv_i8.Bound)
    assert set_activations(model, "fp32") == 4 * CFG.num_layers + 1
    assert not any(type(m) is Int8BlockLinear for m in model.modules())


@needs_vnni
def test_whole_block_call_equals_one_kernel_at_a_time_and_verification_equals_decode(monkeypatch):
    """With int8 activations kernels/cpu_block.py still chains the same kernels as the per-op path (bit-equal
    logits), and rows verified together equal the same rows decoded one at a time (lossless speculation)."""
    model = gguf_model()
    set_activations(model, "int8")
    cpu_fusion.fuse(model)
    prompt, tokens = [3, 14, 15, 9, 26, 5, 35], [8, 9, 7, 9, 3]
    calls = []
    layers_call = cpu_block.decode_layers
    monkeypatch.setattr(cpu_block, "decode_layers", lambda *a: calls.append(1) or layers_call(*a))
    verified, _ = run_steps(model, [prompt, tokens])
    decoded, _ = run_steps(model, [prompt, *([t] for t in tokens)])
    assert len(calls) == 8  # every step, the prefills too, went through the whole-block calls (all blocks in one)
    assert torch.equal(verified[1], torch.cat(decoded[1:]))
    monkeypatch.setattr(cpu_fusion.CpuBlock, "block_weights", lambda self: None)
    ops, _ = run_steps(model, [prompt, tokens])
    assert torch.equal(verified[1], ops[1])
    set_activations(model, "fp32")  # and int8 stays close to float activations
    floats, _ = run_steps(model, [prompt, tokens])
    assert (verified[1] - floats[1]).norm() / floats[1].norm() < 0.02


@needs_vnni
@pytest.mark.parametrize("activations", ["int8", "fp32"])
def test_a_prompts_logits_do_not_depend_on_how_it_was_chunked_or_cached(activations):
    """A prompt prefilled in one step, in chunks, or all but its last token first (what the prefix cache leaves to
    a request): the same logits bit for bit. Prompt rows attend with the decode kernel: under int8 rows the
    float attention of prompts (1e-6 apart) moved activations across a rounding step, and greedy texts from the
    prefix cache diverged from fresh ones (13 of 15 eval prompts on the default model)."""
    model = gguf_model()
    set_activations(model, activations)
    cpu_fusion.fuse(model)
    prompt = [(5 * i + 2) % CFG.vocab_size for i in range(40)]
    whole = run_steps(model, [prompt])[0][-1][-1]
    for chunks in ([39, 1], [20, 20], [7, 16, 17], [35, 5]):
        feeds, start = [], 0
        for n in chunks:
            feeds.append(prompt[start : start + n])
            start += n
        assert torch.equal(run_steps(model, feeds)[0][-1][-1], whole), chunks


@needs_vnni
def test_a_requests_logits_do_not_depend_on_what_its_step_holds_beside_it():
    """A step that mixes a decoding request with another request's prompt of more than cpu_gemv.MAX_ROWS tokens:
    the decoding request's logits equal those of its step run alone bit for bit (its rows take the whole-block call
    either way), and so do the prompt's. Run as one forward, the step's 85 rows took the float GEMM for every row."""
    model = gguf_model()
    set_activations(model, "int8")
    cpu_fusion.fuse(model)
    prompt, long_prompt = [3, 14, 15, 9, 26, 5, 35], [(7 * i + 3) % CFG.vocab_size for i in range(80)]
    assert len(long_prompt) > cpu_gemv.MAX_ROWS

    def step(batch_of: list[int]) -> list[torch.Tensor]:
        """Request 0 (prompt, then its newest token and 4 drafts) and, in `batch_of`, request 1's long prompt."""
        pool = KVPool(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 16, 16, torch.float32, "cpu", cpu_kernels=True)
        runner = ModelRunner(model, pool)
        pool.add(0, prompt)
        runner.forward(StepBatch([0], [prompt], [0], [1]))
        feeds = {0: [8, 9, 7, 9, 3], 1: long_prompt}
        for seq in batch_of:
            if seq == 1:
                pool.add(1, long_prompt)
        starts = {0: len(prompt), 1: 0}
        out = runner.forward(StepBatch(batch_of, [feeds[s] for s in batch_of], [starts[s] for s in batch_of],
                                       [5 if s == 0 else 1 for s in batch_of]))  # fmt: skip
        return out.logits

    decoding_alone, prompt_alone = step([0])[0], step([1])[0]
    mixed = step([1, 0])
    assert torch.equal(mixed[1], decoding_alone) and torch.equal(mixed[0], prompt_alone)


@needs_vnni
def test_a_decoding_requests_logits_do_not_depend_on_how_many_decode_beside_it():
    """Verification of 1 request and of 14 together (70 logit rows, more than cpu_gemv.MAX_ROWS): request 0's
    logits are the same bits; the output head reads its blocks for any row count in a decoding step."""
    model = gguf_model()
    set_activations(model, "int8")
    cpu_fusion.fuse(model)

    def verify(requests: int) -> torch.Tensor:
        pool = KVPool(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, 32, 16, torch.float32, "cpu", cpu_kernels=True)
        runner = ModelRunner(model, pool)
        seqs = list(range(requests))
        prompts = [[3 + s, 14, 15, 9, 26, 5, 35] for s in seqs]
        for s in seqs:
            pool.add(s, prompts[s])
        runner.forward(StepBatch(seqs, prompts, [0] * requests, [1] * requests))
        feeds = [[8, 9, 7, 9, 3 + s] for s in seqs]
        return runner.forward(StepBatch(seqs, feeds, [7] * requests, [5] * requests)).logits[0]

    assert cpu_gemv.MAX_ROWS < 14 * 5
    assert torch.equal(verify(1), verify(14))


PROMPTS = [
    "Write a Python function that reverses a string.",
    "Add type hints to this function and return the whole code:\n\n"
    "def total(prices, tax):\n    result = 0\n    for price in prices:\n        result += price * (1 + tax)\n"
    "    return result\n",
]


@pytest.fixture(scope="module")
def int8_engine():
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(device="cpu", dtype="float32", cpu_act="int8"))


@pytest.mark.slow
@needs_vnni
def test_default_model_reads_every_packed_linear_with_int8_rows(int8_engine):
    packed = [m for m in int8_engine.model.modules() if isinstance(m, BlockLinear)]
    assert len(packed) == 4 * int8_engine.model.cfg.num_layers + 1 and all(type(m) is Int8BlockLinear for m in packed)


@pytest.mark.slow
@needs_vnni
def test_the_default_config_takes_int8_rows_on_this_cpu():
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(device="cpu", dtype="float32"))
    packed = [m for m in engine.model.modules() if isinstance(m, BlockLinear)]
    assert packed and all(type(m) is Int8BlockLinear for m in packed)


@pytest.mark.slow
@needs_vnni
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_is_lossless_with_int8_activations(int8_engine, prompt):
    """Every drafter at k = 4 gives plain greedy decoding's tokens (the verification rows' logits are the decode
    rows' bit for bit)."""
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    encoded = int8_engine.encode_prompt(prompt)
    drafters = ["none", "ngram", "heads", "ngram+heads", "eagle", "draft-model"]
    handles = [int8_engine.submit(encoded, sampling, SpecParams(d, k=0 if d == "none" else 4)) for d in drafters]
    plain, *spec = [h.result() for h in handles]
    for drafter, fin in zip(drafters[1:], spec, strict=True):
        assert fin.token_ids == plain.token_ids, f"{drafter} diverged from plain greedy"
    assert sum(fin.stats.accepted for fin in spec) > 0
