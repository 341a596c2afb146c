"""Where one decode step's GPU time goes: torch profiler over eager steps of a synthetic model (CUDA).

    PYTHONPATH=. python benchmarks/profile_step.py [--shape llama-3.1-8b] [--weights bf16|mxfp4] [--fused]
                                                   [--graph [--pdl on|off]] [--batch B] [--rows R]

Kernels are grouped by name and sorted by total GPU time per step. By default the step runs eagerly (no CUDA
graph), so the GPU time of each kernel is what a graph replay would spend on it, launch gaps aside. --graph
replays the CUDA-graph runner's step (PDL as the runner chooses, or forced by --pdl) and also times whole steps:
with PDL off the step's wall time less its kernels' sum is the gaps between them; with PDL on a kernel launched
early counts its wait for the one before as its own time, so the sum can exceed the wall time. --batch B --rows R
profiles a verification step instead: B requests feed R rows each (a k = R - 1 chain) with logits on every row,
and each keeps one of them after the step, as a step that accepts no draft does.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from specchat.bench.synthetic import SHAPES, quantize_all, random_model
from specchat.engine.kv_cache import KVPool
from specchat.engine.runner import ModelRunner, StepBatch
from specchat.kernels import pdl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--graph", action="store_true", help="replay the CUDA-graph runner's steps")
    parser.add_argument("--pdl", choices=("auto", "on", "off"), default="auto", help="with --graph")
    parser.add_argument("--batch", type=int, default=1, help="requests in the step")
    parser.add_argument("--rows", type=int, default=1, help="rows each request feeds (k + 1 under speculation)")
    args = parser.parse_args()
    with pdl.override({"auto": None, "on": True, "off": False}[args.pdl]):
        profile_steps(args)


def profile_steps(args: argparse.Namespace) -> None:
    cfg = SHAPES[args.shape]
    model = random_model(cfg, torch.bfloat16, torch.device("cuda"))
    if args.weights == "mxfp4":
        quantize_all(model)
    if args.fused:
        from specchat.engine.fusion import fuse

        fuse(model)
    rows, batch = args.rows, args.batch
    page_size = 16
    pages = batch * ((args.context + (args.steps + 60) + rows) // page_size + 2)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, page_size, torch.bfloat16, "cuda")
    if args.graph:
        from specchat.engine.cuda_graph import CudaGraphRunner

        runner = CudaGraphRunner(model, pool)
    else:
        runner = ModelRunner(model, pool)
    prompt = list(range(args.context))
    seqs = list(range(batch))
    for seq in seqs:
        cached = pool.add(seq, prompt)  # the requests after the first find the prompt's whole pages cached
        runner.forward(StepBatch([seq], [prompt[cached:]], [cached], [1]))
    length = args.context

    def step():
        nonlocal length
        runner.forward(StepBatch(seqs, [[1] * rows] * batch, [length] * batch, [rows] * batch))
        length += 1
        if rows > 1:
            for seq in seqs:
                pool.truncate(seq, length)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    wall = ""
    if args.graph:
        start, end, timed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 50
        start.record()
        for _ in range(timed):
            step()
        end.record()
        end.synchronize()
        wall = f", {start.elapsed_time(end) / timed:.3f} ms wall per step (PDL {args.pdl}, PDL up to {runner._pdl_rows} rows)"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in kernels) / args.steps
    print(f"{args.shape} {args.weights} fused={args.fused} graph={args.graph} batch={batch} rows={rows}: "
          f"{total / 1e3:.2f} ms GPU per step, "
          f"{sum(e.count for e in kernels) / args.steps:.0f} kernels per step{wall}")  # fmt: skip
    print("| us per step | calls per step | kernel |\n|---:|---:|---|")
    for e in kernels[:25]:
        print(f"| {e.device_time_total / args.steps:.1f} | {e.count / args.steps:.0f} | {e.key[:90]} |")


if __name__ == "__main__":
    main()
