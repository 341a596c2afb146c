"""A prompt's prefill on the CPU with the block kernels against the float GEMM, side by side in one process.

    python benchmarks/cpu_prefill.py [--cpu-act int8|fp32] [--threads 2] [--lengths 64,128,256,512]

One fresh prompt of N tokens through the engine's ModelRunner on the default model (GGUF blocks, the C kernels),
each way alternating twice, best time kept: "gemm" as a plain step takes it for float rows (above
cpu_gemv.MAX_ROWS rows the dequantized weight's float GEMM), "blocks" with every linear reading its blocks
(`cpu_weights.blocks_for_any_rows`). Int8 rows (`--cpu-act int8`) read the blocks for any row count on their own,
so there both columns time the blocks unless the GEMM is forced (`--force-gemm`, what chose that default).
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import torch

from specchat.config import EngineConfig
from specchat.engine import cpu_weights
from specchat.engine.engine import Engine
from specchat.engine.runner import StepBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-act", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--force-gemm", action="store_true", help="the float GEMM above 64 rows for int8 rows too")
    args = parser.parse_args()
    engine = Engine.load(EngineConfig(device="cpu", cpu_act=args.cpu_act))
    torch.set_num_threads(args.threads)
    if args.force_gemm:
        for module in engine.model.modules():
            if isinstance(module, cpu_weights.BlockLinear):
                module.gemm_for_many_rows = True
    runner, pool = engine.runner, engine.pool
    print(f"| prompt tokens | {args.cpu_act} rows, gemm | {args.cpu_act} rows, blocks |")
    print("|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = [(i * 37) % 40000 + 100 for i in range(n)]
        best = {"gemm": float("inf"), "blocks": float("inf")}
        for mode in ("gemm", "blocks", "gemm", "blocks"):
            pool.add(-5, ids)
            context = cpu_weights.blocks_for_any_rows() if mode == "blocks" else nullcontext()
            start = time.perf_counter()
            with context:
                runner._forward(StepBatch([-5], [ids], [0], [1]))
            best[mode] = min(best[mode], time.perf_counter() - start)
            pool.free(-5)
        print(f"| {n} | {best['gemm'] * 1e3:,.0f} ms | {best['blocks'] * 1e3:,.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
