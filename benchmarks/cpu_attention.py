"""The CPU paged attention (kernels/cpu_attention.py) at the default model's shapes: us per layer call.

    python benchmarks/cpu_attention.py [--threads 1] [--repeats 200] [--kv-dtypes float32,float16,bfloat16]

SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, pages of 16) over random pages in shuffled
order: one request decoding at 128, 512 and 2,048 tokens of context, a k = 4 verification (5 rows) at 512 and
2,048, and 8 requests decoding at 256, over pages of each --kv-dtypes (the kernel's `threads` = --threads). The
median of --repeats calls through the Python wrapper (whose own cost is the context-1 row); each output is
checked against `paged_attention_ref` first. One call's pages stay in the caches between repeats: a decode step
reads each layer's once, from DRAM at long contexts (engine-level figures: docs/benchmarks.md). Before/after: run it in both trees
with benchmarks/ab_trees.sh (`python $PWD/benchmarks/cpu_attention.py`: the base tree need not have it).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specchat.kernels import cpu_attention

# the tests' ragged step over shuffled pages; appended, so that a PYTHONPATH tree (benchmarks/ab_trees.sh) wins
sys.path.append(str(Path(__file__).resolve().parents[1]))
from tests.kernels.test_cpu_ops import paged_case

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
CASES = [([1], [1]), ([1], [128]), ([1], [512]), ([5], [512]), ([1] * 8, [256] * 8), ([1], [2048]), ([5], [2048])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--kv-dtypes", default="float32", help="comma list of float32, float16, bfloat16 (page elements)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, threads {args.threads}")
    print("| pages | requests | new rows each | context | us per layer call | max abs diff vs reference |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.kv_dtypes.split(","):
        dtype = getattr(torch, name)
        extra = {} if dtype == torch.float32 else {"kv_dtype": dtype}  # (a base tree's paged_case may lack it)
        for q_lens, ctx_lens in CASES:
            plan, q, k, v, k_pages, v_pages, _ = paged_case(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, **extra)
            want = cpu_attention.paged_attention_ref(plan, q, k, v, k_pages.clone(), v_pages.clone())
            got = cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, args.threads)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, args.threads)
                times.append((time.perf_counter() - t0) * 1e6)
            err = (got - want).abs().max().item()
            cells = f"{len(q_lens)} | {q_lens[0]} | {ctx_lens[0]} | {statistics.median(times):.1f} | {err:.1e}"
            print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
