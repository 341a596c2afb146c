"""Fp4Linear: packed weights are the only resident copy, and it computes x @ dequant(W)^T + b."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specchat.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from specchat.quant.fp4_linear import Fp4Linear, RotatedFp4Linear, rotate_blocks


def test_cpu_module_holds_only_packed_weights() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(96, 40, bias=True)
    fp4 = Fp4Linear.from_linear(dense, rule="mse")
    buffers = dict(fp4.named_buffers())
    assert set(buffers) == {"codes", "scales"}
    assert buffers["codes"].dtype == torch.uint8 and buffers["codes"].shape == (40, 48)  # 2 codes a byte
    assert buffers["scales"].dtype == torch.uint8 and buffers["scales"].shape == (40, 3)  # one per 32
    assert [name for name, _ in fp4.named_parameters()] == ["bias"]  # no dense weight anywhere
    assert fp4.nbytes == 40 * 48 + 40 * 3


def test_forward_equals_dense_linear_on_dequantized_weight() -> None:
    torch.manual_seed(1)
    dense = nn.Linear(80, 33, bias=True)  # K not a multiple of 32: padded blocks
    codes, scales = quantize_mxfp4(dense.weight.detach(), rule="roundup")
    fp4 = Fp4Linear.from_packed(codes, scales, 80, dense.bias.detach().clone())
    x = torch.randn(7, 80)
    expected = F.linear(x, dequantize_mxfp4(codes, scales, torch.float32, k=80), dense.bias)
    with torch.inference_mode():  # as the engine runs it (the shared scratch buffer is an inference tensor)
        torch.testing.assert_close(fp4(x), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(fp4.packed()[0], codes) and torch.equal(fp4.packed()[1], scales)


def test_to_linear_round_trips_the_values() -> None:
    torch.manual_seed(2)
    fp4 = Fp4Linear.from_linear(nn.Linear(64, 16, bias=False))
    linear = fp4.to_linear(torch.float32)
    assert torch.equal(linear.weight, fp4.dequantized(torch.float32))
    assert torch.equal(Fp4Linear.from_linear(linear).packed()[0], fp4.packed()[0])  # MXFP4 values re-encode exactly


def test_rotated_module_computes_x_times_its_effective_weight() -> None:
    """RotatedFp4Linear holds W R and computes (x R)(W R)^T: the layer of the effective weight dequant(W R) R."""
    torch.manual_seed(3)
    dense = nn.Linear(64, 24, bias=True)
    fp4 = RotatedFp4Linear.from_linear(dense)
    codes, scales = fp4.packed()
    effective = rotate_blocks(dequantize_mxfp4(codes, scales, torch.float32, k=64))  # [N, K]
    assert torch.equal(fp4.dequantized(torch.float32), effective)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(fp4(x), F.linear(x, effective, dense.bias), rtol=1e-5, atol=1e-5)
        relative_error = (fp4(x) - dense(x)).norm() / dense(x).norm()
        assert relative_error < 0.2  # and close to the original layer (4-bit elements)


def test_cpu_kernel_takes_a_steps_rows_and_mxfp4_linear_the_rest() -> None:
    """On the CPU up to cpu_gemv.MAX_ROWS rows go through the C kernel over the codes as stored (the reference's
    values up to float32 sums), each row alone; more rows, and K not whole blocks, through mxfp4_linear."""
    from specchat.kernels import cpu_gemv
    from specchat.kernels.mxfp4_matmul import mxfp4_linear

    if not cpu_gemv.available():
        return
    torch.manual_seed(4)
    for cls in (Fp4Linear, RotatedFp4Linear):
        fp4 = cls.from_linear(nn.Linear(96, 40, bias=True))
        assert fp4.bound() is not None and fp4.bound() is fp4.bound()  # bound once
        x = torch.randn(3, 4, 96)  # 12 rows, batched dims kept
        with torch.inference_mode():
            reference = F.linear(x, fp4.dequantized(torch.float32), fp4.bias)
            got = fp4(x)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
            assert torch.equal(fp4(x[1, 2:3]), got[1, 2:3])  # a row alone: the same bits
            low = fp4(x.bfloat16())  # a bf16 model's rows: widened, multiplied, rounded back
            assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), got, rtol=0.05, atol=0.05)
            many = torch.randn(cpu_gemv.MAX_ROWS + 1, 96)
            plain = many if cls is Fp4Linear else rotate_blocks(many)
            assert torch.equal(fp4(many), mxfp4_linear(plain, fp4.weight_mxfp4, fp4.bias))
    odd = Fp4Linear.from_linear(nn.Linear(80, 8))  # K = 80: padded blocks, mxfp4_linear
    assert odd.bound() is None


def test_int8_rows_repack_the_buffers_in_place_and_take_every_row_count() -> None:
    """set_activations("int8"): the codes and scales become cpu_gemv_i8's layout in place of the interchange ones
    (the same bytes, no copy beside), every row count takes its kernel (fp4_linear_ref's bits, a row alone as in a
    batch), the interchange form and an embedding's rows read back exactly; "fp32" puts the float kernel's back."""
    from specchat.kernels import cpu_gemv, cpu_gemv_i8

    if not cpu_gemv_i8.available():
        return
    torch.manual_seed(5)
    for cls in (Fp4Linear, RotatedFp4Linear):
        fp4 = cls.from_linear(nn.Linear(96, 48, bias=True))
        codes, scales = fp4.packed()
        nbytes, dense = fp4.nbytes, fp4.dequantized(torch.float32)
        assert fp4.set_activations("int8") and fp4.int8_rows
        assert fp4.nbytes == nbytes and set(dict(fp4.named_buffers())) == {"codes", "scales"}
        assert isinstance(fp4.bound(), cpu_gemv_i8.Fp4Bound) and not fp4.takes_gemm(10_000)
        assert torch.equal(fp4.packed()[0], codes) and torch.equal(fp4.packed()[1], scales)
        index = torch.tensor([3, 47, 3])
        assert torch.equal(fp4.rows(index, torch.float32), dense[index])
        x = torch.randn(cpu_gemv.MAX_ROWS + 6, 96)
        with torch.inference_mode():
            got = fp4(x)
            want = cpu_gemv_i8.fp4_linear_ref(x, codes, scales, rotate=cls.rotated) + fp4.bias
            assert torch.equal(got, want) and torch.equal(fp4(x[5:6]), got[5:6])
        assert fp4.set_activations("fp32") and not fp4.int8_rows
        assert torch.equal(fp4.codes, codes) and torch.equal(fp4.scales, scales)
        assert isinstance(fp4.bound(), cpu_gemv.Bound) and fp4.takes_gemm(cpu_gemv.MAX_ROWS + 1)
    odd = Fp4Linear.from_linear(nn.Linear(80, 8))  # K = 80: padded blocks, which the CPU kernels do not read
    assert not odd.set_activations("int8") and not odd.int8_rows


def test_the_engines_mxfp4_linears_take_cpu_act_rows_and_speculation_stays_exact(engine, tiny_model_dir) -> None:
    """A switch to MXFP4 on the CPU gives its linears the rows --cpu-act picks (auto: int8 where cpu_gemv_i8 loads),
    as loading with --weights mxfp4 does (--cpu-act int8 was refused there); greedy speculation equals plain greedy
    decoding on them."""
    from specchat.config import EngineConfig, SamplingParams, SpecParams
    from specchat.engine.engine import Engine
    from specchat.kernels import cpu_gemv_i8

    def rows_of(e: Engine) -> set[bool]:
        return {m.int8_rows for m in e.model.modules() if isinstance(m, Fp4Linear)}

    int8 = cpu_gemv_i8.available()
    engine.set_weights("mxfp4")
    assert rows_of(engine) == {int8}
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = engine.encode_prompt("a b a b a b a b a b")
    plain = engine.submit(prompt, sampling, SpecParams("none", k=0)).result().token_ids
    assert engine.submit(prompt, sampling, SpecParams("ngram", k=4)).result().token_ids == plain
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", weights="mxfp4")
    assert rows_of(Engine.load(config)) == {int8}
    assert rows_of(Engine.load(dataclasses.replace(config, cpu_act="fp32"))) == {False}
    if int8:
        assert rows_of(Engine.load(dataclasses.replace(config, cpu_act="int8"))) == {True}
