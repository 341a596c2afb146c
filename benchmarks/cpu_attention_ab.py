"""The CPU paged attention of this checkout against another tree's, calls interleaved in one process.

    mkdir -p .ab_base && git archive BASE | tar -x -C .ab_base      # git-ignored
    python benchmarks/cpu_attention_ab.py --base .ab_base [--threads 1] [--cases prefill,step] [--calls 30]

Both trees' C sources (kernels/cpu_attention.py's C_SOURCE) are built and bound, and each case's call goes to
one then the other, alternating which goes first, so a machine whose speed drifts (the 2-core VMs this project
measures on moved the same call by up to 2.5x within an hour: docs/benchmarks.md, thirty-fifth session) slows
both alike. Prints per case the median us per layer call of each and their ratio, and whether the two outputs
are bit-equal (a change that keeps every row's arithmetic must keep them so). The cases are
benchmarks/cpu_attention.py's, over pages of --kv-dtype.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specchat.kernels import cpu_attention, cpu_build, cpu_ops

sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.base_source import module_source
from benchmarks.cpu_attention import CASES, HEAD_DIM, HEADS, KV_HEADS, PAGE, PREFILL
from tests.kernels.test_cpu_ops import paged_case


def base_library(tree: Path):
    """The base tree's attention kernel, built under its own name and bound as this checkout's is."""
    source = module_source(tree, "cpu_attention")
    lib = cpu_build.load("cpu_attention_base", cpu_ops.C_SOURCE + source, cpu_ops.CFLAGS)
    if lib is None:
        sys.exit(f"cpu_attention_ab: the base tree's kernel at {tree} did not build")
    head = cpu_attention._library()
    lib.paged_attention.argtypes = head.paged_attention.argtypes
    lib.paged_attention.restype = head.paged_attention.restype
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="a tree holding the base commit's specchat/")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default="prefill,step", help="comma list of step, prefill (cpu_attention.py's)")
    ap.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--calls", type=int, default=30, help="calls of each build per case")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"base": base_library(args.base), "head": cpu_attention._library()}
    own = cpu_attention._library
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, threads {args.threads}, "
          f"{args.kv_dtype} pages, base {args.base}")  # fmt: skip
    print("| requests | new rows each | context | base us | head us | head vs base | bit-equal |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    cases = {"step": CASES, "prefill": PREFILL}
    for q_lens, ctx_lens in [c for part in args.cases.split(",") for c in cases[part]]:
        plan, q, k, v, k_pages, v_pages, _ = paged_case(
            q_lens, ctx_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE, kv_dtype=getattr(torch, args.kv_dtype)
        )
        times, outs = {"base": [], "head": []}, {}
        try:
            for call in range(args.calls):
                for name in ("base", "head") if call % 2 else ("head", "base"):
                    cpu_attention._library = lambda lib=libs[name]: lib
                    t0 = time.perf_counter()
                    outs[name] = cpu_attention.paged_attention(plan, q, k, v, k_pages, v_pages, args.threads)
                    times[name].append((time.perf_counter() - t0) * 1e6)
        finally:
            cpu_attention._library = own
        base, head = statistics.median(times["base"]), statistics.median(times["head"])
        same = torch.equal(outs["base"], outs["head"])
        print(
            f"| {len(q_lens)} | {q_lens[0]} | {ctx_lens[0]} | {base:.1f} | {head:.1f} | {base / head:.2f}x | {same} |"
        )


if __name__ == "__main__":
    main()
