"""The CPU paged attention (kernels/cpu_attention.py) at the default model's shapes: us per layer call.

    python benchmarks/cpu_attention.py [--threads 1] [--repeats 200]

SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, pages of 16) over random pages in shuffled
order: one request decoding at 128 and 512 tokens of context, a k = 4 verification (5 rows) at 512, and 8
requests decoding at 256. The median of --repeats calls through the Python wrapper (whose own cost is the
context-1 row); each output is checked against `paged_attention_ref` first. Before/after: run it in both trees
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
CASES = [([1], [1]), ([1], [128]), ([1], [512]), ([5], [512]), ([1] * 8, [256] * 8), ([1], [2048]), ([5], [2048])]  # q_lens, context lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, threads {args.threads}")
    print("| requests | new rows each | context | us per layer call | max abs diff vs reference |")
    print("|---:|---:|---:|---:|---:|")
    for q_lens, ctx_lens in CASES:
        plan, q, k, v, k_pages, v_pages, _ = paged_case(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE)
        want = cpu_attention.paged_attention_ref(plan, q, k, v, k_pages.clone(), v_pages.clone())
        got = cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages)
            times.append((time.perf_counter() - t0) * 1e6)
        err = (got - want).abs().max().item()
        print(f"| {len(q_lens)} | {q_lens[0]} | {ctx_lens[0]} | {statistics.median(times):.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
