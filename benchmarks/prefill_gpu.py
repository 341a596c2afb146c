"""Prefill speed of the synthetic Llama-3.1-8B on the GPU: MXFP4 weights through the matmul kernel alone, MXFP4
through mxfp4_linear's default (the weight decoded for cuBLAS from DENSE_MIN_ROWS rows on, in prefill graphs from
GRAPHED_DENSE_MIN_ROWS), and bf16 weights.

    PYTHONPATH=. python benchmarks/prefill_gpu.py [--contexts 512,2048,8192] [--batch 4] [--rounds 2]

One process, one model per weight format, the two MXFP4 paths alternated round by round: each row is the
synthetic bench's prefill speed (`specchat bench --synthetic`: `batch` prompts of `context` random tokens, one
forward each, after one untimed prompt of the same length), the median over rounds, and its ratio to the
kernel-only MXFP4 row and to bf16.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from specchat.bench.synthetic import SHAPES, SyntheticCase, quantize_all, random_model, run_case
from specchat.engine.loading import make_runner
from specchat.kernels import mxfp4_matmul

KERNEL_ONLY = 1 << 62  # a threshold of rows that no step reaches


def prefill_tok_s(model, context: int, batch: int, kernel_only: bool) -> float:
    saved = mxfp4_matmul.DENSE_MIN_ROWS, mxfp4_matmul.GRAPHED_DENSE_MIN_ROWS
    if kernel_only:
        mxfp4_matmul.DENSE_MIN_ROWS = mxfp4_matmul.GRAPHED_DENSE_MIN_ROWS = KERNEL_ONLY
    try:
        runner = functools.partial(make_runner, eager=False)
        return run_case(model, SyntheticCase(batch=batch), context, steps=1, runner_factory=runner).prefill_tok_per_s
    finally:
        mxfp4_matmul.DENSE_MIN_ROWS, mxfp4_matmul.GRAPHED_DENSE_MIN_ROWS = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (float32 there)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    model = random_model(SHAPES[args.shape], dtype, device)
    quantize_all(model)
    for _ in range(args.rounds):
        for context in contexts:
            for label, kernel_only in (("mxfp4, kernel", True), ("mxfp4, default", False)):
                results.setdefault((label, context), []).append(prefill_tok_s(model, context, args.batch, kernel_only))
                print(f"{label}, context {context}: {results[label, context][-1]:,.0f} tok/s", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = random_model(SHAPES[args.shape], dtype, device)
    for _ in range(args.rounds):
        for context in contexts:
            results.setdefault(("bf16", context), []).append(prefill_tok_s(model, context, args.batch, True))
            print(f"bf16, context {context}: {results['bf16', context][-1]:,.0f} tok/s", flush=True)
    print(
        f"\n{args.shape} prefill, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, batch {args.batch} prompts a context, median of "
        f"{args.rounds} rounds; mxfp4 default: the decoded weight for eager steps of >= {mxfp4_matmul.DENSE_MIN_ROWS} "
        f"rows, prefill graphs of >= {mxfp4_matmul.GRAPHED_DENSE_MIN_ROWS}"
    )
    print("\n| context | weights | prefill tok/s | vs MXFP4 kernel only | vs bf16 |\n|---:|---|---:|---:|---:|")
    for context in contexts:
        kernel = statistics.median(results["mxfp4, kernel", context])
        bf16 = statistics.median(results["bf16", context])
        for label in ("mxfp4, kernel", "mxfp4, default", "bf16"):
            value = statistics.median(results[label, context])
            print(f"| {context} | {label} | {value:,.0f} | {value / kernel:.2f}x | {value / bf16:.2f}x |")


if __name__ == "__main__":
    main()
