"""Where one decode step's GPU time goes: torch profiler over eager steps of a synthetic model (CUDA).

    PYTHONPATH=. python benchmarks/profile_step.py [--shape llama-3.1-8b] [--weights bf16|mxfp4] [--fused]

Kernels are grouped by name and sorted by total GPU time per step; the step runs eagerly (no CUDA graph), so
the GPU time of each kernel is what a graph replay would spend on it, launch gaps aside.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.bench.synthetic import SHAPES, quantize_all, random_model
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import ModelRunner, StepBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cfg = SHAPES[args.shape]
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    if args.weights == "mxfp4":
        quantize_all(model)
    if args.fused:
        from specchat.engine.fusion import fuse

        fuse(model)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, 16, torch.bfloat16, "cuda")
    runner = ModelRunner(model, pool)
    prompt = list(range(args.context))
    pool.add(0, prompt)
    runner.forward(StepBatch([0], [prompt], [0], [1]))
    length = args.context

    def step():
        nonlocal length
        runner.forward(StepBatch([0], [[1]], [length], [1]))
        length += 1

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / args.steps
    print(f"{args.shape} {args.weights} fused={args.fused}: {total / 1e3:.2f} ms GPU per step, "
          f"{sum(e.count for e in rows) / args.steps:.0f} kernels per step")  # fmt: skip
    print("| us per step | calls per step | kernel |\n|---:|---:|---|")
    for e in rows[:25]:
        print(f"| {e.device_time_total / args.steps:.1f} | {e.count / args.steps:.0f} | {e.key[:90]} |")


if __name__ == "__main__":
    main()
