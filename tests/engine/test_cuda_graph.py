"""CUDA-graph replay equals the eager ModelRunner (runs where a CUDA device is; skipped on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from specchat.bench.synthetic import SHAPES, random_model
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import ModelRunner, StepBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def make_pool(cfg, kv: str) -> KVPool:
    return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 512, 16, torch.bfloat16, "cuda", kv_format=kv)


def test_mxfp4_prefill_graph_of_many_rows_multiplies_the_decoded_weights(monkeypatch):
    """A fresh prompt of 600 tokens on MXFP4 weights replays the 1024 bucket's prefill graph, which captured the
    decoded-copy path (GRAPHED_DENSE_MIN_ROWS: its warm-ups took it too, compiling the decode and growing the
    scratch), and equals the eager runner (the MXFP4 kernel at 600 rows)."""
    from specchat.bench.synthetic import quantize_all
    from specchat.engine.cuda_graph import CudaGraphRunner
    from specchat.kernels import mxfp4_matmul

    torch.manual_seed(0)
    cfg = SHAPES["smollm2-135m"]
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    quantize_all(model)
    captured = []
    dense = mxfp4_matmul.dequantized_linear

    def counting(*args, **kwargs):
        captured.append(torch.cuda.is_current_stream_capturing())
        return dense(*args, **kwargs)

    monkeypatch.setattr(mxfp4_matmul, "dequantized_linear", counting)
    eager, graphed = ModelRunner(model, make_pool(cfg, "bf16")), CudaGraphRunner(model, make_pool(cfg, "bf16"))
    prompt = torch.randint(0, cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for runner in (eager, graphed):
        runner.pool.add(0, prompt)
        logits.append(runner.forward(StepBatch([0], [prompt], [0], [1])).logits[0])
    assert any(captured) and not captured[0], "no prefill graph captured the decoded copy after warming it up"
    assert (1024, ()) in graphed.prefills
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kv, fused", [("bf16", False), ("mxfp4", False), ("bf16", True), ("mxfp4", True)])
def test_graph_replay_equals_eager(kv, fused):
    """The fast path (CUDA graphs, with or without the fused elementwise kernels) against the plain runner."""
    from specchat.engine.cuda_graph import CudaGraphRunner
    from specchat.engine.fusion import fuse

    torch.manual_seed(0)
    cfg = SHAPES["smollm2-135m"]
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    fast_model = copy.deepcopy(model)
    if fused:
        assert fuse(fast_model) > 0
    eager, graphed = ModelRunner(model, make_pool(cfg, kv)), CudaGraphRunner(fast_model, make_pool(cfg, kv))
    gen = torch.Generator().manual_seed(1)
    lengths = [37, 5, 130]  # three requests, prefilled eagerly by both runners
    for runner in (eager, graphed):
        for i, n in enumerate(lengths):
            prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            runner.pool.add(i, prompt)
            runner.forward(StepBatch([i], [prompt], [0], [1]))
    for step, q in enumerate([1, 1, 4, 1, 3]):  # decode and verification shapes, batch 3 (bucket 4) then 2
        ids = list(range(3 if step < 3 else 2))
        feeds = [torch.randint(0, cfg.vocab_size, (q,), generator=gen).tolist() for _ in ids]
        starts = [eager.pool.length(i) for i in ids]
        batch = StepBatch(ids, feeds, starts, [q] * len(ids))
        want = eager.forward(batch).logits
        got = graphed.forward(batch).logits
        for w, g in zip(want, got, strict=True):
            # fused: the same fp32 math rounded alike, but sums in another order, through 30 bf16 layers
            tol = 5e-2 if fused else 2e-2
            torch.testing.assert_close(g, w, atol=tol, rtol=tol)
            top = w.gather(-1, g.argmax(-1, keepdim=True)).squeeze(-1)  # the reference's logit of our choice
            assert torch.all(w.max(-1).values - top <= (0 if not fused else tol))  # argmax, up to rounding ties
    assert graphed.graphs, "no step was replayed from a graph"


def test_graphed_function_equals_the_function_and_follows_its_weights():
    """GraphedFunction (a drafter's chain): replays equal direct calls at any batch (padded to its bucket), a
    capture per (bucket, key), and graphs dropped when the signature of the tensors they read changes."""
    from specchat.engine.cuda_graph import GraphedFunction

    torch.manual_seed(0)
    weight = {"w": torch.randn(64, 64, device="cuda")}

    def chain(depth, x, t):
        for _ in range(depth):
            x = torch.tanh(x @ weight["w"]) + t[:, None]
        return x

    graphed = GraphedFunction(chain, lambda: weight["w"].data_ptr())
    for n in (1, 3, 8, 5):
        x, t = torch.randn(n, 64, device="cuda"), torch.randn(n, device="cuda")
        for depth in (1, 3):
            torch.testing.assert_close(graphed(depth, x, t), chain(depth, x, t))  # the bucket's GEMM may round apart
    assert set(graphed.graphs) == {(b, d) for b in (1, 4, 8) for d in (1, 3)}
    weight["w"] = torch.randn(64, 64, device="cuda")  # a weight switch: the old graphs read freed memory
    x, t = torch.randn(2, 64, device="cuda"), torch.randn(2, device="cuda")
    torch.testing.assert_close(graphed(3, x, t), chain(3, x, t))
    assert set(graphed.graphs) == {(2, 3)}
    graphed.warm_up(5, [1], lambda depth: (x[:1], t[:1]))  # every batch bucket a run of 5 at once meets
    assert {(b, 1) for b in (1, 2, 4, 8)} <= set(graphed.graphs)
    off = GraphedFunction(chain, enabled=False)
    off.warm_up(5, [1], lambda depth: (x[:1], t[:1]))
    assert torch.equal(off(3, x, t), chain(3, x, t)) and not off.graphs


@pytest.mark.parametrize(("weights", "kv"), [("mxfp4", "bf16"), ("mxfp4", "mxfp4"), ("bf16", "bf16")])
def test_pdl_steps_equal_steps_without_it(weights, kv, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) only lets each kernel start before the one ahead of it
    finishes: every kernel still waits for its inputs, so graphed and eager steps of an MXFP4 model, or a bf16 one
    whose linears run the dense GEMV, with fused kernels give bit-identical logits with it on and off (a kernel
    that read before its wait would not)."""
    from specchat.bench.synthetic import quantize_all
    from specchat.engine.cuda_graph import CudaGraphRunner
    from specchat.engine.fusion import fuse
    from specchat.kernels import dense_gemv, pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    monkeypatch.setattr(dense_gemv, "ENABLED", True)
    torch.manual_seed(0)
    cfg = SHAPES["smollm2-135m"]
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    bf16_runner = CudaGraphRunner(random_model(cfg, torch.bfloat16, torch.device("cuda")), make_pool(cfg, kv))
    if weights == "mxfp4":
        quantize_all(model)
    assert fuse(model) > 0
    dense = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    fuse(dense)
    # on by default where every kernel of a step is ours: MXFP4 layers; dense ones through the GEMV (<= 16 rows)
    assert CudaGraphRunner(model, make_pool(cfg, kv))._pdl_rows == (float("inf") if weights == "mxfp4" else 16)
    assert bf16_runner._pdl_rows == 0
    assert CudaGraphRunner(dense, make_pool(cfg, kv))._pdl_rows == dense_gemv.MAX_ROWS
    results = {}
    for on in (False, True):
        with pdl.override(on):
            assert pdl.enabled(torch.device("cuda")) == on
            for kind in (ModelRunner, CudaGraphRunner):
                runner = kind(model, make_pool(cfg, kv))
                gen = torch.Generator().manual_seed(1)
                logits = []
                for i, n in enumerate([37, 5, 130]):
                    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
                    runner.pool.add(i, prompt)
                    logits.append(runner.forward(StepBatch([i], [prompt], [0], [1])).logits[0])
                for q in (1, 1, 4, 1, 3):  # decode and verification steps of all three
                    feeds = [torch.randint(0, cfg.vocab_size, (q,), generator=gen).tolist() for _ in range(3)]
                    starts = [runner.pool.length(i) for i in range(3)]
                    logits += runner.forward(StepBatch([0, 1, 2], feeds, starts, [q] * 3)).logits
                torch.cuda.synchronize()
                results[on, kind.__name__] = logits
    for kind in ("ModelRunner", "CudaGraphRunner"):
        for off, on in zip(results[False, kind], results[True, kind], strict=True):
            assert torch.equal(off, on), kind
