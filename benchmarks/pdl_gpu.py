"""Programmatic dependent launch (kernels/pdl.py) against launches without it, side by side in one process on
CUDA (issue 14: the step's small work and the GEMV's ramp).

    PYTHONPATH=. python benchmarks/pdl_gpu.py [--cases llama-3.1-8b:mxfp4:bf16:1,llama-3.1-8b:mxfp4:bf16:32:4,...]
                                              [--rounds 3] [--steps 128] [--context 512]

A case is SHAPE:WEIGHTS:KV:BATCH[:K] (K drafts per step of the benchmark-only drafter, acceptance 0.8 when K > 0):
a random-weight model of the named shape (specchat/bench/synthetic.py) on the product's runner (`make_runner`:
fused kernels and CUDA graphs). The two settings alternate on the same weights, `--rounds` times, each with its
own runner and graphs; the table gives the median tok/s of each and their ratio. Prints one table.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from specchat.bench.synthetic import SHAPES, SyntheticCase, quantize_all, random_model, run_case
from specchat.engine.loading import make_runner
from specchat.kernels import mxfp4_matmul_kernel, pdl

DEFAULT_CASES = (
    "smollm2-135m:bf16:bf16:1,smollm2-135m:bf16:bf16:32,"
    "llama-3.1-8b:mxfp4:bf16:1,llama-3.1-8b:mxfp4:bf16:8,llama-3.1-8b:mxfp4:bf16:32,llama-3.1-8b:mxfp4:bf16:1:4,"
    "llama-3.1-8b:mxfp4:bf16:32:4,llama-3.1-8b:bf16:bf16:1"
)


def parse_case(spec: str) -> tuple[str, SyntheticCase]:
    shape, weights, kv, batch, *k = spec.split(":")
    drafts = int(k[0]) if k else 0
    return shape, SyntheticCase(
        batch=int(batch), weights=weights, kv=kv, k=drafts, acceptance=(0.8,) if drafts else (0.0,)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefetch", type=int, help="weight iterations the matmul prefetches before its wait")
    args = parser.parse_args()
    if args.prefetch is not None:
        mxfp4_matmul_kernel.PREFETCH_ITERATIONS = args.prefetch
    cases = [parse_case(spec) for spec in args.cases.split(",")]
    device = torch.device("cuda")
    assert pdl.enabled(device), "PDL is off here (compute capability < 9.0, or SPECCHAT_PDL=0)"
    factory = functools.partial(make_runner, eager=False)
    print(f"context {args.context}, {args.steps} steps, median of {args.rounds} rounds (off and on alternate), "
          f"matmul prefetch {mxfp4_matmul_kernel.PREFETCH_ITERATIONS} iterations")  # fmt: skip
    print("| model | weights | KV | batch | decoding | PDL off tok/s | PDL on tok/s | on / off | step ms off -> on |")
    print("|---|---|---|---:|---|---:|---:|---:|---|")
    models: dict[tuple[str, str], torch.nn.Module] = {}
    for shape, case in cases:
        key = (shape, case.weights)
        if key not in models:
            models.clear()
            torch.cuda.empty_cache()
            model = random_model(SHAPES[shape], torch.bfloat16, device)
            if case.weights == "mxfp4":
                quantize_all(model)
            models[key] = model
        model = models[key]
        speeds: dict[bool, list[float]] = {False: [], True: []}
        steps: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                with pdl.override(on):
                    result = run_case(model, case, args.context, args.steps, runner_factory=factory)
                speeds[on].append(result.tok_per_s)
                steps[on].append(result.step_ms)
        off, on = (statistics.median(speeds[v]) for v in (False, True))
        ms_off, ms_on = (statistics.median(steps[v]) for v in (False, True))
        decoding = f"k={case.k}, a=0.8" if case.k else "plain"
        print(f"| {shape} | {case.weights} | {case.kv} | {case.batch} | {decoding} | {off:,.1f} | {on:,.1f} | "
              f"{on / off:.3f}x | {ms_off:.3f} -> {ms_on:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
