"""The default model with its GGUF blocks read by the CPU kernels (engine/cpu_weights.py) against the eager
float32 model, and lossless speculation on that path against plain decoding."""

from __future__ import annotations

import pytest
import torch

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.cpu_weights import BlockLinear, unpack
from specchat.kernels import cpu_gemv

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler")]

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
]


@pytest.fixture(scope="module")
def eager_engine():
    from specchat.engine.engine import Engine

    return Engine.load(EngineConfig(device="cpu", dtype="float32", eager=True))


def greedy(engine, prompt: str, drafter: str = "none") -> list[int]:
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    return engine.submit(engine.encode_prompt(prompt), params, SpecParams(drafter=drafter)).result().token_ids


def test_every_linear_is_packed(default_engine, eager_engine):
    packed = [m for m in default_engine.model.modules() if isinstance(m, BlockLinear)]
    assert len(packed) == 4 * default_engine.model.cfg.num_layers + 1  # + lm_head (Q8_0)
    assert not any(isinstance(m, BlockLinear) for m in eager_engine.model.modules())


def test_packed_weights_are_the_float_weights(default_engine, eager_engine):
    """The blocks hold the loader's float32 values bit for bit, whole and by rows (the heads' draft rows)."""
    eager = dict(eager_engine.model.named_modules())
    for name, module in default_engine.model.named_modules():
        if isinstance(module, BlockLinear):
            assert torch.equal(module.dequantized(), eager[name].weight), name
            index = torch.tensor([0, 7, module.out_features - 1])
            assert torch.equal(module.rows(index, torch.float32), eager[name].weight[index]), name


def test_int8_rows_free_the_float_weights(default_engine, eager_engine):
    """Under int8 activation rows (the default where the CPU has them) no block linear reads its float weight, so
    the load drops them (the tied head's is the embedding's); `.weight` still reads as the values, and the model's
    counted bytes are the blocks'. fp32 rows take the float GEMM for a prompt: the weights come back, the same
    values."""
    from specchat.engine.cpu_weights import release_unread_weights, set_activations
    from specchat.kernels import cpu_gemv_i8
    from specchat.quant.modules import weight_bytes

    if not cpu_gemv_i8.available():
        pytest.skip("no int8 activation kernels on this CPU")
    model, wqkv = default_engine.model, eager_engine.model.layers[0].attn.wqkv.weight
    layers = [m for m in model.modules() if isinstance(m, BlockLinear) and m is not model.lm_head]
    assert layers and all(m.holds_weight for m in layers)  # the fixture's fp32 rows
    fp32_bytes = weight_bytes(model)
    try:
        set_activations(model, "int8")
        assert release_unread_weights(model) == len(layers) + 1  # the head's blocks too
        assert not any(m.holds_weight for m in layers)
        assert model.lm_head.weight is model.embed.weight
        assert torch.equal(layers[0].weight, wqkv)
        memory = default_engine.memory()
        assert memory["weights_bytes"] == weight_bytes(model) < fp32_bytes * 0.7
        assert memory["weights_gguf"] == "Q4_1+Q8_0"
    finally:
        set_activations(model, "fp32")
    assert all(m.holds_weight for m in layers) and torch.equal(layers[0]._parameters["weight"], wqkv)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_eager(default_engine, eager_engine, prompt):
    assert greedy(default_engine, prompt) == greedy(eager_engine, prompt)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_exact_on_packed_path(default_engine, prompt):
    assert greedy(default_engine, prompt, "ngram") == greedy(default_engine, prompt)


def test_unpack_restores_plain_linears(tiny_engine):
    assert unpack(tiny_engine.model) == 0  # an HF model has no GGUF blocks: nothing was packed


def test_a_switch_back_from_mxfp4_reads_the_gguf_blocks_again(tmp_path):
    """Live weights switch on the CPU: MXFP4 and back leaves the linears reading the file's blocks (with the
    activation rows the config picks), as at load, and the same greedy tokens; the switch back once put plain
    float linears there, slower and numerically another path."""
    from specchat.engine.engine import Engine
    from tests.engine.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))

    def kinds() -> list[type]:
        return [type(m) for m in engine.model.modules() if isinstance(m, BlockLinear)]

    def tokens() -> list[int]:
        sampling = SamplingParams(max_tokens=12, ignore_eos=True)
        return engine.submit("hello there", sampling, SpecParams("none", k=0)).result().token_ids

    at_load, first = kinds(), tokens()
    assert len(at_load) == 9  # 2 layers x 4 block linears + the head
    engine.set_weights("mxfp4")
    assert kinds() == []
    engine.set_weights("bf16")
    assert kinds() == at_load and tokens() == first


def test_a_bf16_model_gets_its_kernel_linears_back_after_mxfp4(tiny_model_dir):
    """A bf16 model on the CPU: MXFP4 and back leaves its linears cpu_weights.Bf16Linear again, as at load (the
    switch back reads plain dense linears), with the same greedy tokens."""
    from specchat.engine.cpu_weights import Bf16Linear
    from specchat.engine.engine import Engine

    engine = Engine.load(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="bfloat16"))

    def tokens() -> list[int]:
        sampling = SamplingParams(max_tokens=8, ignore_eos=True)
        return engine.submit("hello there", sampling, SpecParams("none", k=0)).result().token_ids

    first = tokens()
    assert type(engine.model.lm_head) is Bf16Linear
    engine.set_weights("mxfp4")
    engine.set_weights("bf16")
    assert type(engine.model.lm_head) is Bf16Linear and type(engine.model.layers[0].attn.wqkv) is Bf16Linear
    assert tokens() == first


def test_auto_dtype_keeps_float32_where_the_block_kernels_read_a_gguf(tmp_path, monkeypatch):
    """On a CPU with native bf16, `auto` gives a GGUF model float32 (its block kernels compute in float32; a bf16
    model would skip them: 19.9 against 112 tok/s, docs/benchmarks.md), a dense model bfloat16, and --eager (no
    block kernels) bfloat16 too."""
    from specchat.engine import loading
    from specchat.engine.engine import Engine
    from tests.engine.tiny_gguf import write_tiny_gguf

    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: True)
    cpu = torch.device("cpu")
    assert loading.pick_dtype("auto", cpu, cpu_blocks=True) == torch.float32
    assert loading.pick_dtype(None, cpu) == torch.bfloat16
    assert loading.pick_dtype("bfloat16", cpu, cpu_blocks=True) == torch.bfloat16  # as asked

    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    engine = Engine.load(EngineConfig(model=str(path), device="cpu"))
    assert next(engine.model.parameters()).dtype == torch.float32
    assert any(isinstance(m, BlockLinear) for m in engine.model.modules())
    eager = Engine.load(EngineConfig(model=str(path), device="cpu", eager=True))
    assert next(eager.model.parameters()).dtype == torch.bfloat16


def test_a_new_weight_makes_a_block_linear_plain():
    """Assigning a weight to a linear that reads GGUF blocks (GPTQ does, to a block's twin, with the quantized
    values) makes it a plain linear over that weight: the blocks would go on multiplying the old one."""
    from torch import nn

    from specchat.engine.cpu_weights import quantize_q8_0, release_unread_weights, set_activations
    from specchat.engine.drafters.heads_cpu import block_linear

    torch.manual_seed(0)
    old = torch.randn(48, 64)
    linear = block_linear(old, quantize_q8_0(old), "q8_0")
    release_unread_weights(linear)
    new = torch.randn(48, 64)
    linear.weight = nn.Parameter(new, requires_grad=False)
    assert type(linear) is nn.Linear and not linear._buffers
    x = torch.randn(3, 64)
    assert torch.equal(linear(x), x @ new.T)
    assert set_activations(linear, "fp32") == 0


def test_a_switch_of_weights_frees_the_old_ones_at_once(tmp_path):
    """The CPU kernels' bindings hold the weights they bound; a live switch drops them, so the old linears are
    freed by the switch, not at the next step's binding (a process after a switch held 678-730 MB, 510-611 once
    they and the heap's free pages went)."""
    import weakref

    from specchat.engine.engine import Engine
    from tests.engine.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", blocks=True)
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.submit("hello there", sampling, SpecParams("none", k=0)).result()  # a step: the blocks bound
    old = weakref.ref(engine.model.layers[0].attn.wqkv)
    assert isinstance(old(), BlockLinear) and "_bound_layers" in engine.model.__dict__
    engine.set_weights("mxfp4")
    assert old() is None
    engine.submit("hello there", sampling, SpecParams("none", k=0)).result()
