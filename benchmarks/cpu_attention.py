"""The CPU paged attention (kernels/cpu_attention.py) at the default model's shapes: us per layer call.

    python benchmarks/cpu_attention.py [--threads 1] [--repeats 200] [--kv-dtypes float32,float16,bfloat16,k8v4,mxfp4]

SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, pages of 16) over random pages in shuffled
order: one request decoding at 128, 512 and 2,048 tokens of context, a k = 4 verification (5 rows) at 512 and
2,048, and 8 requests decoding at 256 (`--cases step`), and a prompt's chunk of 64 rows ending at 1,024 and 2,048
tokens (`--cases prefill`), over pages of each --kv-dtypes (the kernel's `threads` = --threads; k8v4
and mxfp4 pages with the pools' Hadamard rotation: the call rotates and quantizes the step's rows too). The
median of --repeats calls through the Python wrapper (whose own cost is the context-1 row); each output is
checked against `paged_attention_ref` (`paged_attention_quantized_ref`) first. One call's pages stay in the caches between repeats: a decode step
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
CASES = [
    ([1], [1]),
    ([1], [128]),
    ([1], [256]),
    ([2], [256]),
    ([3], [256]),
    ([1], [512]),
    ([5], [512]),
    ([1] * 8, [256] * 8),
    ([1], [2048]),
    ([5], [2048]),
]
PREFILL = [([64], [1024]), ([64], [2048])]  # --cases prefill: a prompt's chunk of 64 rows ending at that context
QUANTIZED = {"k8v4": ("mxfp8", "mxfp4"), "mxfp4": ("mxfp4", "mxfp4")}  # (key, value) element formats


def quantized_call(q_lens: list[int], ctx_lens: list[int], formats: tuple[str, str], threads: int):
    """(the call over quantized pages of these (key, value) formats, rotated as a pool's, its output against the
    reference's max abs difference)."""
    from tests.kernels.test_cpu_ops import clone_pages, page_rotation, quantized_case

    plan, q, k, v, k_pages, v_pages, _ = quantized_case(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, formats)
    rot = page_rotation("hadamard", KV_HEADS, HEAD_DIM)
    want = cpu_attention.paged_attention_quantized_ref(plan, q, k, v, clone_pages(k_pages), clone_pages(v_pages), rot)
    got = cpu_attention.paged_attention_quantized(plan, q, k, v, k_pages, v_pages, rot, threads)
    call = lambda: cpu_attention.paged_attention_quantized(plan, q, k, v, k_pages, v_pages, rot, threads)
    return call, (got - want).abs().max().item()


def dense_call(q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype, threads: int):
    """(the call over dense pages of dtype, its output against the reference's max abs difference)."""
    extra = {} if dtype == torch.float32 else {"kv_dtype": dtype}  # (a base tree's paged_case may lack it)
    plan, q, k, v, k_pages, v_pages, _ = paged_case(q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, **extra)
    want = cpu_attention.paged_attention_ref(plan, q, k, v, k_pages.clone(), v_pages.clone())
    got = cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, threads)
    call = lambda: cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, threads)
    return call, (got - want).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--kv-dtypes", default="float32", help="comma list of float32, float16, bfloat16 (page elements)")
    ap.add_argument("--cases", default="step,prefill", help="comma list of step (decode and verification), prefill")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, threads {args.threads}")
    print("| pages | requests | new rows each | context | us per layer call | max abs diff vs reference |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.kv_dtypes.split(","):
        cases = {"step": CASES, "prefill": PREFILL}
        for q_lens, ctx_lens in [c for part in args.cases.split(",") for c in cases[part]]:
            if name in QUANTIZED:
                call, err = quantized_call(q_lens, ctx_lens, QUANTIZED[name], args.threads)
            else:
                call, err = dense_call(q_lens, ctx_lens, getattr(torch, name), args.threads)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e6)
            cells = f"{len(q_lens)} | {q_lens[0]} | {ctx_lens[0]} | {statistics.median(times):.1f} | {err:.1e}"
            print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
