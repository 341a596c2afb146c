"""The layer fusions of engine/fusion.py (residual add + norm, KV write in the rotary kernel) against the elementwise
fusions alone, side by side in one process on CUDA (issue 14, "the step's small work").

    PYTHONPATH=. python benchmarks/fusion_gpu.py [--cases smollm2-135m:bf16,llama-3.1-8b:bf16,llama-3.1-8b:mxfp4]
                                                 [--batch 1,8] [--rounds 3] [--steps 128] [--context 512]

Each case is a random-weight model of the named shape (specchat/bench/synthetic.py: the engine's ModelRunner with
CUDA graphs, a paged bf16 KV pool, plain decoding). The two variants alternate on the same weights, `--rounds`
times; the table gives the median tok/s of each and their ratio, and the GPU kernels per step of each variant
(torch profiler over eager steps). Prints one table; pass `| tee` to keep it.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.bench.synthetic import SHAPES, SyntheticCase, quantize_all, random_model, run_case
from specchat.engine.cuda_graph import CudaGraphRunner
from specchat.engine.fusion import FusedAttention, FusedTransformer, fuse, swap_classes, unfuse
from specchat.engine.kv_cache import KVPool
from specchat.engine.model import Attention, Transformer
from specchat.engine.runner import ModelRunner, StepBatch

VARIANTS = ("elementwise", "layers")


def set_variant(model: Transformer, variant: str) -> None:
    """elementwise: one kernel per norm / rotary / activation (the fusions before the layer ones); layers: all."""
    unfuse(model)
    fuse(model)
    if variant == "elementwise":
        swap_classes(model, {FusedTransformer: Transformer, FusedAttention: Attention})


def kernels_per_step(model: Transformer, context: int, steps: int = 4) -> float:
    cfg = model.cfg
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, -(-(context + 16) // 16) + 1, 16,
                  torch.bfloat16, "cuda")  # fmt: skip
    runner = ModelRunner(model, pool)
    prompt = list(range(context))
    pool.add(0, prompt)
    runner.forward(StepBatch([0], [prompt], [0], [1]))
    for i in range(2):
        runner.forward(StepBatch([0], [[1]], [context + i], [1]))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            runner.forward(StepBatch([0], [[1]], [context + 2 + i], [1]))
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_time_total > 0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="smollm2-135m:bf16,llama-3.1-8b:bf16,llama-3.1-8b:mxfp4")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    print("| model | weights | batch | elementwise tok/s | layers tok/s | layers / elementwise | kernels per step |")
    print("|---|---|---:|---:|---:|---:|---|")
    for spec in args.cases.split(","):
        shape, weights = spec.split(":")
        model = random_model(SHAPES[shape], torch.bfloat16, torch.device("cuda"))
        if weights == "mxfp4":
            quantize_all(model)
        kernels = {}
        for variant in VARIANTS:
            set_variant(model, variant)
            kernels[variant] = kernels_per_step(model, args.context)
        for batch in batches:
            speeds: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    set_variant(model, variant)
                    case = SyntheticCase(batch=batch, weights=weights)
                    result = run_case(model, case, args.context, args.steps, runner_factory=CudaGraphRunner)
                    speeds[variant].append(result.tok_per_s)
            plain, fused = (statistics.median(speeds[v]) for v in VARIANTS)
            print(f"| {shape} | {weights} | {batch} | {plain:,.1f} | {fused:,.1f} | {fused / plain:.3f}x | "
                  f"{kernels['elementwise']:.0f} -> {kernels['layers']:.0f} |", flush=True)  # fmt: skip
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
