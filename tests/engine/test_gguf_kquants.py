"""GGUF files in the types most models are published in (Q4_K_M: Q4_K with Q6_K for some tensors; Q4_0, Q5_*)
on the CPU's block kernels (engine/cpu_weights.py): each type's conversion against gguf's own dequantization, and a
Q4_K_M-like file decoding on the block kernels as the float model decodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specchat.config import EngineConfig, SamplingParams, SpecParams
from specchat.engine.cpu_weights import BLOCKS_STAGE, BlockEmbedding, BlockLinear, as_q4_1, as_q8_0
from specchat.kernels import cpu_gemv
from specchat.registry import derived_dir
from tests.engine.tiny_gguf import random_kquant, write_tiny_gguf

needs_kernels = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler")
ROWS, COLUMNS = 8, 512


def values(raw: np.ndarray, gguf_type: str) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(ROWS, COLUMNS).copy())


def test_q4_k_reads_as_q4_1_blocks_of_its_values():
    """Each sub-block of 32 is a Q4_1 block (scale d * sc, offset -dmin * mn): the same values as gguf's
    dequantization where those products fit float16 (power-of-two super-block scales, as here)."""
    raw = random_kquant("Q4_K", ROWS, COLUMNS, np.random.default_rng(0))
    codes, d, m = as_q4_1(raw, "Q4_K", ROWS)
    assert codes.shape == (ROWS, COLUMNS // 2) and d.shape == m.shape == (ROWS, COLUMNS // 32)
    assert torch.equal(cpu_gemv.q4_dequantize(codes, d, m), values(raw, "Q4_K"))


def test_q4_k_scales_that_float16_cannot_hold_are_rounded_by_at_most_its_step():
    raw = random_kquant("Q4_K", ROWS, COLUMNS, np.random.default_rng(1)).reshape(-1, 144)
    scales = np.random.default_rng(2).uniform(1e-4, 3e-4, size=(raw.shape[0], 2)).astype(np.float16)
    raw[:, 0:4] = scales.view(np.uint8)
    raw = raw.reshape(ROWS, -1)
    codes, d, m = as_q4_1(raw, "Q4_K", ROWS)
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())  # what the int8 kernels hold
    ref = values(raw, "Q4_K")
    bound = 2.0**-11 * (15 * d.abs() + m.abs()).repeat_interleave(32, dim=1)  # half a float16 step of each
    error = (cpu_gemv.q4_dequantize(codes, d, m) - ref).abs()
    assert (error <= bound + 1e-9).all() and error.max() > 0


def test_q4_0_reads_as_q4_1_exactly():
    raw = quantize(np.random.default_rng(3).standard_normal((ROWS, COLUMNS)).astype(np.float32),
                   GGMLQuantizationType.Q4_0)  # fmt: skip
    assert torch.equal(cpu_gemv.q4_dequantize(*as_q4_1(raw, "Q4_0", ROWS)), values(raw, "Q4_0"))


@pytest.mark.parametrize("gguf_type", ["Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q8_0"])
def test_other_types_read_as_q8_0_within_half_its_step(gguf_type: str):
    """Requantized from gguf's values by gguf's Q8_0 quantizer (Q8_0 itself as stored): each value within half a
    Q8_0 step of its block (d / 2), and the rounding of d to float16 at the block's largest code (127 times half
    a float16 step: d 2^-11, or 2^-25 where d is subnormal)."""
    rng = np.random.default_rng(4)
    if gguf_type.endswith("_K"):
        raw = random_kquant(gguf_type, ROWS, COLUMNS, rng)
    else:
        raw = quantize(rng.standard_normal((ROWS, COLUMNS)).astype(np.float32), GGMLQuantizationType[gguf_type])
    codes, d = as_q8_0(raw, gguf_type, ROWS)
    error = (cpu_gemv.q8_dequantize(codes, d) - values(raw, gguf_type)).abs()
    assert (error <= d.repeat_interleave(32, dim=1) * (0.5 + 127 * 2.0**-11) + 127 * 2.0**-25).all()
    assert (error.max() == 0) == (gguf_type == "Q8_0")


@needs_kernels
def test_a_q4_k_m_file_decodes_on_the_block_kernels(tmp_path):
    """Every linear of a Q4_K_M-like file reads blocks (Q4_1 where all its tensors are Q4_K, else Q8_0) and the
    memory panel names both. Under float32 rows greedy decoding gives the tokens of the float model whose weights
    are the blocks' values (the kernels differ from a float GEMM in summation order only); under the default rows
    speculation equals plain decoding, and a second load (from the blocks cache) decodes the same."""
    from specchat.engine.engine import Engine

    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", kquants=True)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)

    def greedy(engine: Engine, drafter: str = "none") -> list[int]:
        spec = SpecParams(drafter, k=3 if drafter != "none" else 0)
        return engine.submit("hello there", sampling, spec).result().token_ids

    eager = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", eager=True))
    tokens, stages = [], []
    for cpu_act in ("fp32", "auto", "auto"):  # the last one from the blocks cache
        config = EngineConfig(model=str(path), device="cpu", dtype="float32", cpu_act=cpu_act)
        engine = Engine.load(config, lambda what, done, total: stages.append((what, done, total)))
        blocks = {name: m for name, m in engine.model.named_modules() if isinstance(m, BlockLinear)}
        kinds = {name: (m.kind, m.source) for name, m in blocks.items()}
        assert len(kinds) == 9
        assert kinds["layers.0.attn.wqkv"] == ("q8_0", "Q4_K+Q6_K") and kinds["layers.1.mlp.w_down"] == ("q8_0", "Q6_K")
        assert kinds["layers.0.mlp.w_gate_up"] == kinds["layers.1.attn.wo"] == ("q4_1", "Q4_K")
        assert engine.weights.memory()["weights_gguf"] == "Q4_1+Q8_0 from Q4_K+Q6_K"
        if cpu_act == "fp32":
            for name, linear in blocks.items():
                eager.model.get_submodule(name).weight.copy_(linear.dequantized())
            assert greedy(engine) == greedy(eager)
        tokens.append(greedy(engine))
        assert greedy(engine, "ngram") == tokens[-1]
        engine.close()
    assert tokens[1] == tokens[2]
    converted = [(done, total) for what, done, total in stages if what == BLOCKS_STAGE]
    assert converted[-1] == (10, 10) and len(converted) == 10  # the first load's 9 linears and embedding; no other


@needs_kernels
def test_a_blocks_cache_written_before_k_quants_were_read_is_rebuilt(tmp_path):
    """A cache of an earlier version held only a K-quant file's Q4_1 / Q8_0 linears (here: none) and no format:
    read as it is, the file's K-quant linears would stay float32 weights."""
    from safetensors.torch import save_file

    from specchat.engine.engine import Engine

    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", kquants=True)
    cache = derived_dir(path) / "cpu_blocks.safetensors"
    cache.parent.mkdir(parents=True, exist_ok=True)
    save_file({}, str(cache), metadata={})  # what the old code wrote for a file of no Q4_1 / Q8_0 linear
    engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert sum(isinstance(m, BlockLinear) for m in engine.model.modules()) == 9
    engine.close()


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_a_large_k_quant_file_is_never_held_in_float32_on_the_cpu(tmp_path, monkeypatch, tied: bool):
    """Past GGUF_CACHE_MAX_BYTES in float32 (an 8B model: 32 GB) the loader leaves the linears the CPU blocks read
    as meta tensors instead of dequantizing them, and the embedding; the blocks then stand for them (a prompt's
    float GEMM under fp32 rows reads `.weight`, made from the blocks per call; the embedding looks its rows up in
    the head's blocks where tied, else in its own), and the model decodes as it does when its float weights were loaded,
    under either activation rows."""
    from specchat.engine import loader
    from specchat.engine.cpu_weights import deferred_tensors
    from specchat.engine.engine import Engine
    from specchat.quant.fp4_linear import TiedEmbedding

    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", kquants=True, tied=tied)
    _, small = loader.load_gguf(path, defer=deferred_tensors)
    assert not any(t.is_meta for t in small.values())  # a model the cache takes is read whole, as before
    sampling, plain = SamplingParams(max_tokens=24, ignore_eos=True), SpecParams("none", k=0)
    prompts = ["hello there", "hello there " * 25]  # the second: more rows than the block kernels take

    def answers(cpu_act: str, deferring: bool) -> list[list[int]]:
        engine = Engine.load(EngineConfig(model=str(path), device="cpu", dtype="float32", cpu_act=cpu_act))
        blocks = [m for m in engine.model.modules() if isinstance(m, BlockLinear)]
        assert len(blocks) == 9 and (not deferring or not any(m.holds_weight for m in blocks))
        embed = engine.model.embed  # read from blocks where deferred: the head's if tied, else its own
        assert isinstance(embed, TiedEmbedding) == deferring and isinstance(embed, BlockEmbedding) == (deferring > tied)
        out = [engine.submit(engine.encode_prompt(p), sampling, plain).result().token_ids for p in prompts]
        engine.close()
        return out

    expected = {cpu_act: answers(cpu_act, deferring=False) for cpu_act in ("auto", "fp32")}
    with monkeypatch.context() as patch:
        patch.setattr(loader, "GGUF_CACHE_MAX_BYTES", 0)
        _, large = loader.load_gguf(path, defer=deferred_tensors)
        linears = ("wqkv.weight", "wo.weight", "w_gate_up.weight", "w_down.weight", "lm_head.weight")
        linears += ("embed.weight",)
        assert {name for name, t in large.items() if t.is_meta} == {name for name in large if name.endswith(linears)}
        deferred, load_gguf = [], loader.load_gguf

        def counted(*args, **kwargs):
            cfg, state = load_gguf(*args, **kwargs)
            deferred.append(len({id(t) for t in state.values() if t.is_meta}))
            return cfg, state

        patch.setattr(loader, "load_gguf", counted)
        for cpu_act in ("auto", "fp32"):
            (derived_dir(path) / "weights.safetensors").unlink(missing_ok=True)  # (the float cache of the loads above)
            assert answers(cpu_act, deferring=True) == expected[cpu_act]
        assert deferred == [9, 9] if tied else [10, 10]  # (a tied head is the embedding's tensor)


DEFERRED_LOAD = """
import sys
from specchat.config import EngineConfig, SamplingParams
from specchat.engine import loader
from specchat.engine.engine import Engine

loader.GGUF_CACHE_MAX_BYTES = 0  # a large file: its linears deferred as meta tensors
deferred, load_gguf = [], loader.load_gguf


def counted(*args, **kwargs):
    cfg, state = load_gguf(*args, **kwargs)
    deferred.append(sum(t.is_meta for t in state.values()))
    return cfg, state


loader.load_gguf = counted
engine = Engine.load(EngineConfig(model=sys.argv[1], device="cpu"))
assert not any(t.is_meta for t in engine.model.state_dict().values())
engine.submit("hello", SamplingParams(max_tokens=2, ignore_eos=True)).result()
print(deferred, "torch._dynamo" in sys.modules)
"""


def test_a_deferred_load_does_not_import_torchs_compiler(tmp_path):
    """Fusing deferred (meta) q/k/v and gate/up tensors makes a meta tensor of the rows directly: torch.cat's meta
    kernel imports torch._dynamo, which took 1.5-1.6 s of a 2.4 s load of a 1B GGUF from its blocks cache and
    ~0.15 GB of its memory (docs/benchmarks.md, forty-sixth session)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", kquants=True)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "SPECCHAT_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED_LOAD, str(path)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    deferred, dynamo = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert deferred != "[]" and "0" not in deferred.strip("[]").split(", "), deferred  # the load deferred tensors
    assert dynamo == "False"
