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
import time

import torch

from specchat.kernels import cpu_attention
from specchat.kernels.attention import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
CASES = [([1], [1]), ([1], [128]), ([1], [512]), ([5], [512]), ([1] * 8, [256] * 8)]  # q_lens, context lengths


def case(q_lens: list[int], ctx_lens: list[int], seed: int = 0):
    """(plan, q, k, v, k_pages, v_pages): a step over shuffled pages, each request's earlier context stored."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // PAGE) for c in ctx_lens]
    order = torch.randperm(sum(counts), generator=g).tolist()
    tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    num_slots = len(order) * PAGE
    k_pages, v_pages = torch.randn(2, KV_HEADS, num_slots, HEAD_DIM, generator=g)
    rows = zip(tables, q_lens, ctx_lens, strict=True)
    slots = [t[p // PAGE] * PAGE + p % PAGE for t, n, c in rows for p in range(c - n, c)]
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(2, tokens, KV_HEADS, HEAD_DIM, generator=g)
    meta = AttentionMetadata.build(tables, q_lens, ctx_lens, PAGE, "cpu")
    plan = cpu_attention.AttentionPlan(
        meta.block_tables, meta.q_starts, meta.q_lens, meta.ctx_lens, torch.tensor(slots), PAGE,
        HEADS, KV_HEADS, HEAD_DIM, num_slots, HEAD_DIM**-0.5,
    )  # fmt: skip
    return plan, q, k, v, k_pages, v_pages


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
        plan, q, k, v, k_pages, v_pages = case(q_lens, ctx_lens)
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
